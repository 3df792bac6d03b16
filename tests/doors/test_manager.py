"""CheckpointManager bookkeeping on a tiny two-leaf model (fast): schedule, explicit saves,
retention, misuse errors, window="auto" on CPU."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from overlap_ckpt.errors import ConfigError
from overlap_ckpt.doors.linen import TrainState
from overlap_ckpt.manager import CheckpointManager
from overlap_ckpt.storage import CheckpointStore

from conftest import compile_threads


def make_state():
    params = {"w": jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10, "b": jnp.zeros(3)}
    return TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def batch(t):
    return jnp.full((2, 4), 0.1 * (t + 1), jnp.float32)


def run(mngr, state, start, stop):
    for t in range(start, stop):
        state = mngr.step(train_step(state, batch(t)))
    return state


def own_step(name, activation):
    """A jitted step (donating the state) of its own: ``jit(<name>)`` is compiled by no other
    test, so the compiles a test counts by name (``compile_threads``) are its own."""
    def step(state, x):
        grads = jax.grad(lambda p: jnp.sum(activation(x @ p["w"] + p["b"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    step.__name__ = step.__qualname__ = name
    return jax.jit(step, donate_argnums=0)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path, save_interval_steps=0)
    with pytest.raises(ConfigError):
        CheckpointManager(tmp_path, save_interval_steps=4, window="big")


def blocking_store(path, **kwargs):
    """A store that waits for room instead of dropping saves: these tests check the
    schedule and retention, which must not depend on how fast this machine persists."""
    return CheckpointStore(path, on_backpressure="block", **kwargs)


def test_schedule_auto_window_retention_and_queries(tmp_path):
    with CheckpointManager(save_interval_steps=2, window="auto",
                           store=blocking_store(tmp_path, max_to_keep=2)) as mngr:
        state = mngr.prepare(make_state())
        assert mngr.engine.schedule.k == 1  # CPU backend
        assert [mngr.should_save(s) for s in range(5)] == [False, False, True, False, True]
        state = run(mngr, state, 0, 7)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 6] and mngr.latest_step() == 6
        assert int(state.step) == 7 and state.ckpt_outbox is None
    with CheckpointManager(tmp_path, save_interval_steps=2, max_to_keep=2, window=1) as mngr:
        restored = mngr.restore(target_state=make_state())
        assert int(restored.step) == 6


def test_window_clamped_to_interval_and_final_save(tmp_path):
    with CheckpointManager(save_interval_steps=2, window=5, store=blocking_store(tmp_path)) as mngr:
        state = mngr.prepare(make_state())
        assert mngr.engine.schedule.k == 2
        state = run(mngr, state, 0, 5)        # windows of 2 and 4 complete
        assert mngr.save(4, state) is False    # already saved by its window
        assert mngr.save(5, state) is False    # not a save step
        assert mngr.save(5, state, force=True) is True
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 4, 5]
        raw, _ = mngr.store.restore(5)
        np.testing.assert_array_equal(raw["params"]["w"], np.asarray(state.params["w"]))
        assert int(raw["step"]) == 5


def test_sync_save_of_open_window_wins(tmp_path):
    # K=2, interval 4: step 3 opens the window of V=4; saving 4 synchronously first means
    # the window is not submitted again (no duplicate-step error in the background).
    with CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        state = run(mngr, mngr.prepare(make_state()), 0, 4)
        assert mngr.save(4, state) is True
        state = run(mngr, state, 4, 6)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4]


def test_misuse_errors(tmp_path):
    with CheckpointManager(tmp_path, save_interval_steps=1, window=1) as mngr:
        state = run(mngr, mngr.prepare(make_state()), 0, 1)  # step 0 precedes the first window
        assert mngr.next_window_phase == 0
        state = train_step(state, batch(1))
        stripped = state.replace(ckpt_outbox=None)
        with pytest.raises(RuntimeError, match="exactly once per training step"):
            mngr.step(stripped)
    with CheckpointManager(tmp_path / "b", save_interval_steps=4, window=1) as mngr:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            mngr.restore()  # without a target it returns the saved tree, like Orbax: none here
        # step() before prepare() prepares; outside windows the state is passed through.
        state = mngr.step(make_state())
        assert mngr.engine.plan is not None and state.ckpt_outbox is None
        assert mngr.step(state) is state


def test_train_step_compiles_once_per_window_phase(tmp_path):
    """K+1 variants (the user's own step, phases 0..K-1), and no recompiles when committed
    window outputs replace the uncommitted arrays of a fresh state."""
    import functools

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    import overlap_ckpt as oc

    model = nn.Dense(3)
    x = jnp.ones((4, 5))
    state = oc.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
                                 tx=optax.adam(1e-2))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state):
        grads = jax.grad(lambda p: jnp.sum(state.apply_fn({"params": p}, x) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    with oc.CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        state = mngr.prepare(state)
        for t in range(13):
            state = mngr.step(train_step(state))
            if t % 4 == 0:  # let each persist finish: this test is about compiles, not back-pressure
                mngr.wait_until_finished()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8, 12]
    assert train_step._cache_size() == 3


def test_compile_ahead_moves_window_compiles_off_the_training_thread(tmp_path):
    """With compile_ahead, the training thread compiles only the user's own program: the
    window variants are compiled in the background while plain steps run."""
    compiles = compile_threads("jit(ahead_step)")  # the thread of every compile of this test's step

    ahead_step = own_step("ahead_step", jnp.sin)

    with CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        state = mngr.prepare(make_state())
        compiling = mngr.compile_ahead(ahead_step, state, batch(0))
        state = mngr.step(ahead_step(state, batch(0)))  # the user's program compiles first...
        compiling.join()  # ...then, in the background, the window variants
        assert compiles == [threading.main_thread().name] + ["overlap-ckpt-compile-ahead"] * 2
        for t in range(1, 9):
            state = mngr.step(ahead_step(state, batch(t)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]
    assert len(compiles) == 3, compiles  # nothing compiled on the training thread after that


def test_compile_ahead_with_skip_also_compiles_the_variants_of_a_skipped_window(tmp_path):
    """With on_host_budget="skip", a window declined for host memory runs its steps as a
    variant that copies nothing (the trajectory stays that of the schedule). compile_ahead
    compiles those too: a skip happens when the host is already under pressure, the worst
    moment for a compile of the whole step on the training thread."""
    from overlap_ckpt.storage import hooks

    compiles = compile_threads("jit(skipped_step)")  # the thread of every compile of this test's step

    skipped_step = own_step("skipped_step", jnp.sinh)

    release = threading.Event()
    previous = hooks.set_fault_hook(lambda stage, info: release.wait(60)
                                    if stage == "start" and info["step"] == 4 else None)
    try:
        with CheckpointManager(tmp_path / "probe", save_interval_steps=4, window=2) as probe:
            probe.prepare(make_state())
            one_checkpoint = sum(probe.engine.footprint())
        with CheckpointManager(tmp_path / "run", save_interval_steps=4, window=2, on_host_budget="skip",
                               max_host_bytes=one_checkpoint) as mngr:
            state = mngr.prepare(make_state())
            compiling = mngr.compile_ahead(skipped_step, state, batch(0))
            state = mngr.step(skipped_step(state, batch(0)))
            compiling.join()
            for t in range(1, 9):  # step 8's window starts while step 4's persist is stuck
                state = mngr.step(skipped_step(state, batch(t)))
            release.set()
            mngr.wait_until_finished()
            assert mngr.skipped_steps() == [8] and mngr.all_steps() == [4]
    finally:
        release.set()
        hooks.set_fault_hook(previous)
    assert compiles.count(threading.main_thread().name) == 1, compiles  # the user's own program only


class HeldEvent(threading.Event):
    """Stands in for compile-ahead's first-step event: the compile-ahead thread waiting on it
    wakes when the first step has run, then is held until ``release`` is set."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def wait(self, timeout=None):
        woke = super().wait(timeout)
        self.release.wait(60)
        return woke


def test_compile_ahead_takes_what_to_compile_from_the_training_thread(tmp_path):
    """The compile thread read the engine's plan itself once the first step had run. When
    window="auto" re-planned at that moment (the plan is None between set_window and
    plan_for), the thread died with an AttributeError (seen in CI). The thread is held
    here between its wake-up and its work, while the plan is away."""
    held_step = own_step("held_step", jnp.cosh)

    errors = []
    hook, threading.excepthook = threading.excepthook, lambda args: errors.append(args.exc_value)
    try:
        with CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
            state = mngr.prepare(make_state())
            mngr._ahead._stepped = held = HeldEvent()  # the event the compile thread waits on
            compiling = mngr.compile_ahead(held_step, state, batch(0))
            state = mngr.step(held_step(state, batch(0)))
            plan, mngr.engine.plan = mngr.engine.plan, None  # as a re-plan leaves it for a moment
            held.release.set()
            compiling.join()
            mngr.engine.plan = plan
            assert errors == [] and mngr._ahead._error is None, (errors, mngr._ahead._error)
            for t in range(1, 9):
                state = mngr.step(held_step(state, batch(t)))
            mngr.wait_until_finished()
            assert mngr.all_steps() == [4, 8]
    finally:
        threading.excepthook = hook


def test_a_window_reached_before_compile_ahead_finished_waits_for_its_variants(tmp_path):
    """A loop that does not sync every step reaches the first window within milliseconds of
    dispatch, while compile_ahead may still be compiling its variants. The window step then
    compiled its variant again on the training thread, beside the background compile of the
    same program (measured on the 20M LM, K=3, loss fetched every 5 steps: 2.7x the plain
    loop's compile time on the training thread). It waits for the background compile instead.
    The compile thread is held here until after the window's first step has been handed out."""
    compiles = compile_threads("jit(early_step)")  # the thread of every compile of this test's step

    early_step = own_step("early_step", jnp.arctan)

    with CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        state = mngr.prepare(make_state())
        mngr._ahead._stepped = held = HeldEvent()  # the event the compile thread waits on
        compiling = mngr.compile_ahead(early_step, state, batch(0))
        state = mngr.step(early_step(state, batch(0)))
        releaser = threading.Timer(0.5, held.release.set)  # the compile thread starts late
        releaser.start()
        t = 1
        while mngr.next_window_phase != 0:  # up to the step that readies the window's first
            state, t = mngr.step(early_step(state, batch(t))), t + 1
        assert held.release.is_set(), "the window step was readied without waiting for its variants"
        for t in range(t, 9):
            state = mngr.step(early_step(state, batch(t)))
        compiling.join()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]
    assert compiles.count(threading.main_thread().name) == 1, compiles  # the user's own program only


def test_compile_ahead_compiles_the_host_replay_before_the_first_window(tmp_path):
    """The host replay's programs compile on the compile-ahead thread too, not on the replay
    thread at the first window (where XLA's working memory added to the window's own)."""
    replay_compiles = compile_threads("jit(run)")  # the thread of every compile of the replay's program
    zeros_compiles = compile_threads("jit(zeros)")  # and of its first calls' output buffers

    replayed_step = own_step("replayed_step", jnp.cos)

    with CheckpointManager(tmp_path, save_interval_steps=4, window=3) as mngr:
        state = mngr.prepare(make_state())
        compiling = mngr.compile_ahead(replayed_step, state, batch(0))
        state = mngr.step(replayed_step(state, batch(0)))
        compiling.join()
        ahead, zeros_ahead = list(replay_compiles), list(zeros_compiles)
        for t in range(1, 13):
            state = mngr.step(replayed_step(state, batch(t)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8, 12]
    assert ahead and set(ahead) == {"overlap-ckpt-compile-ahead"}, ahead
    assert replay_compiles == ahead, replay_compiles  # none at the windows
    assert zeros_ahead and set(zeros_ahead) == {"overlap-ckpt-compile-ahead"}, zeros_ahead
    assert zeros_compiles == zeros_ahead, zeros_compiles
