"""core.engine: re-planning, window changes, and windows through the whole loop."""

import threading

import jax
import jax.numpy as jnp
import optax
import pytest

from overlap_ckpt import MemorySink, OverlapEngine

from conftest import check_windows, make_params, run_loop


def test_back_to_back_windows_k_equals_interval():
    _, sink, refs = run_loop(optax.adam(1e-2), make_params([(30, 4), (4,)]), window=4, interval=4, steps=17)
    assert sorted(sink.saved) == [4, 8, 12, 16]
    check_windows(sink, refs)


def test_window_larger_than_interval_is_clamped(caplog):
    engine = OverlapEngine(optax.sgd(0.1), MemorySink(), interval=3, window=5)
    assert engine.schedule.k == 3
    assert "clamped" in caplog.text
    engine.close()


def test_tree_change_mid_window_discards_the_window_and_replans():
    """The tree grows by a leaf at phase 1 of the window of 4: that window is discarded at
    once (never persisted half old, half new), the next ones are planned for the new tree
    and equal the synchronous snapshots bitwise."""
    tx = optax.adam(1e-2)
    seen = {}

    def grow_at_phase_1_of_window_4(t, engine, params, opt_state):
        if t != 3:
            return None
        assert engine.phase(t) == 1 and engine.schedule.version(t, 1) == 4
        seen["old_plan"] = engine.plan
        engine.flush()
        seen["aborted_before"] = engine.windows_aborted
        bigger = {**params, "w999": jnp.ones((2,), jnp.float32)}
        return bigger, jax.tree.map(jnp.copy, tx.init(bigger))

    def check_abort_is_immediate(t, engine, params, opt_state):
        changed = grow_at_phase_1_of_window_4(t, engine, params, opt_state)
        if t == 4:  # still inside the window of 4: discarded now, not at the next window
            engine.flush()
            seen["aborted_at_change"] = engine.windows_aborted
            seen["new_plan"] = engine.plan
        return changed

    engine, sink, refs = run_loop(tx, make_params([(8, 3)]), window=3, interval=4, steps=13,
                                  before_step=check_abort_is_immediate)
    assert (seen["aborted_before"], seen["aborted_at_change"]) == (0, 1)
    assert seen["new_plan"] is not seen["old_plan"] and len(seen["new_plan"].params) == 2
    assert sorted(sink.saved) == [8, 12] and engine.windows_completed == 2
    del refs[4]  # the discarded window's version: never handed to the sink
    check_windows(sink, refs)


def test_set_window_replans_and_clamps():
    tx = optax.adam(1e-2)
    engine = OverlapEngine(tx, MemorySink(), interval=4, window=1)
    params = make_params([(12, 3), (3,)])
    assert engine.plan_for(params, tx.init(params)).k == 1
    engine.set_window(3)  # what auto-K does once it has measured the step
    assert engine.schedule.k == 3 and engine.plan_for(params, tx.init(params)).k == 3
    engine.set_window(9)
    assert engine.schedule.k == 4  # clamped to the save interval
    engine.close()


def test_submit_drops_windows_the_run_does_not_capture():
    tx = optax.adam(1e-2)
    params = make_params([(8, 3)])
    engine = OverlapEngine(tx, MemorySink(), interval=4, window=2)
    engine.plan_for(params, tx.init(params), {"step": jnp.int32(0)})
    engine.start(4)  # a resume at 4: the window of 4 began at step 3
    ticket = engine.ticket(4)
    assert ticket is not None and ticket.phase == 1  # the step still runs the window variant
    from overlap_ckpt.core.ticket import Outbox
    assert engine.submit(4, Outbox(ticket, [], [], [], [], [])) is False
    engine.close()


def test_a_closed_engine_refuses_outboxes_and_its_flush_returns():
    """After close() the worker is gone: a submitted outbox was queued for nobody (the
    checkpoint lost without a word) and wait_until_finished() waited forever."""
    tx = optax.adam(1e-2)
    params = make_params([(8, 3)])
    engine = OverlapEngine(tx, MemorySink(), interval=4, window=1)
    engine.plan_for(params, tx.init(params), {"step": jnp.int32(0)})
    ticket = engine.ticket(3)
    from overlap_ckpt.core.ticket import Outbox
    engine.close()
    waiting = threading.Thread(target=engine.wait_until_finished, daemon=True)
    waiting.start()
    waiting.join(30)
    assert not waiting.is_alive(), "wait_until_finished() on a closed engine waits forever"
    with pytest.raises(RuntimeError, match="engine is closed.*step 3 was not taken"):
        engine.submit(3, Outbox(ticket, [], [], [], [], []))
