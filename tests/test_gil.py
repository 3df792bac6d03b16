"""Our host worker gives the GIL to the training thread between leaves (overlap_ckpt.gil)."""

import functools
import sys
import threading

import jax
import jax.numpy as jnp
import optax
import pytest

import overlap_ckpt as oc
from overlap_ckpt import gil


@pytest.fixture
def no_forced_switch():
    """A switch interval far longer than the background loop (200 items of ~0.3 ms): the
    training thread gets the GIL only when the thread holding it gives it up, as it would
    5 ms later in normal operation."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(2.0)
    yield
    sys.setswitchinterval(old)


def _spin(n: int = 20_000) -> int:
    return sum(range(n))  # pure Python: holds the GIL throughout


def test_a_waiting_thread_gets_the_gil_between_items_of_a_background_loop(no_forced_switch):
    events: list[str] = []
    started = threading.Event()

    def training_step():
        _ = jnp.zeros(()) + 1  # jax releases the GIL, as when freeing a donated array

    # Compiled (and the backend started) before the race: a first call compiles with the GIL
    # released, on a loaded host for longer than the whole background loop, which then ends
    # unopposed. A probe under load reproduced CI's failure (1 of 20 steps) only that way.
    training_step()

    @gil.background
    def worker():
        for i in gil.yielding(range(200)):
            _spin()
            events.append("worker")
            if i == 0:
                started.set()

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()  # gives the GIL up; taking it back waits for the worker to yield
    for _ in range(20):
        events.append("training")
        training_step()
    thread.join()
    last_worker = len(events) - 1 - events[::-1].index("worker")
    assert events[:last_worker].count("training") == 20, (
        "the training thread waited for the whole background loop")


def test_only_marked_threads_yield(monkeypatch):
    calls = []
    monkeypatch.setattr(gil, "_give_up_gil", lambda: calls.append(threading.current_thread().name))

    def slow_items():
        return [_spin() for _ in gil.yielding(range(5))]

    slow_items()
    assert calls == []  # the training thread keeps the GIL
    thread = threading.Thread(target=gil.background(slow_items), name="ours")
    thread.start()
    thread.join()
    assert calls == ["ours"] * 5


def test_the_host_worker_yields_in_its_hand_off_and_the_training_thread_does_not(tmp_path, monkeypatch):
    threads = []
    monkeypatch.setattr(gil, "_give_up_gil", lambda: threads.append(threading.current_thread().name))
    params = {f"layer{i}": {"w": jnp.full((4, 4), 0.1 * i), "b": jnp.zeros((4,))} for i in range(6)}

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state):
        return state.apply_gradients(grads=jax.tree.map(jnp.ones_like, state.params))

    state = oc.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    with oc.CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        state = mngr.prepare(state)
        for _ in range(9):
            state = mngr.step(train_step(state))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]
    assert set(threads) == {"overlap-ckpt-replay"}
    leaves = len(jax.tree.leaves(state))
    assert threads.count("overlap-ckpt-replay") >= 2 * leaves  # two windows, every leaf handed off
