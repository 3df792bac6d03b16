"""The window context: how a step learns it is in a window with nothing in the user's state.

Its cost is on other jitted functions the loop calls while a ticket is out: they are keyed
on it too. The property that keeps that cheap: each compiles at most once per window phase
and is reused by every later window (the plan, and so the ticket, compares by value).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import optax

import overlap_ckpt as oc
from overlap_ckpt.core.window_context import current_ticket, hand_to_next_step, window_ticket


def test_the_ticket_is_thread_local_and_keys_jit():
    traced = []

    @jax.jit
    def f(x):
        traced.append(current_ticket())
        return x + 1

    f(1.0)
    hand_to_next_step("phase-0")
    try:
        seen = []
        other = threading.Thread(target=lambda: seen.append(current_ticket()))
        other.start()
        other.join()
        assert seen == [None]  # the engine's and the compile-ahead threads are not in the window
        f(1.0)
        f(1.0)
        with window_ticket("phase-1"):
            f(1.0)
        assert current_ticket() == "phase-0"  # a with block restores what was handed out
    finally:
        hand_to_next_step(None)
    f(1.0)
    assert traced == [None, "phase-0", "phase-1"]  # one trace per value, then cache hits


def test_other_jitted_functions_compile_once_per_phase_then_never_again(tmp_path):
    params = {"w": jnp.ones((4, 3)) / 4, "b": jnp.zeros(3)}
    x = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    eval_traces = []

    @jax.jit
    def evaluate(params):  # called on the loop's thread between steps, as eval/metrics code is
        eval_traces.append(current_ticket())
        return jnp.sum(params["w"])

    state = oc.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    with oc.CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        state = mngr.prepare(state)
        for t in range(13):  # windows of 4, 8 and 12
            evaluate(state.params)
            state = mngr.step(train_step(state))
            if mngr.next_window_phase == 0:
                mngr.wait_until_finished()  # no checkpoint dropped for a slow disk: this is about compiles
            if t == 4:
                after_first_window = len(eval_traces)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8, 12]
    assert after_first_window == 3  # the plain program and one per window phase
    assert len(eval_traces) == 3, [None if t is None else t.phase for t in eval_traces]
    assert current_ticket() is None  # closing the manager leaves plain steps behind
