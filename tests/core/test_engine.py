"""core.engine: re-planning, window changes, and windows through the whole loop."""

import jax.numpy as jnp
import optax

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
    tx = optax.adam(1e-2)
    engine = OverlapEngine(tx, MemorySink(), interval=4, window=3)
    params = make_params([(8, 3)])
    plan = engine.plan_for(params, tx.init(params))
    bigger = make_params([(8, 3), (2,)])
    new_plan = engine.plan_for(bigger, tx.init(bigger))
    assert new_plan is not plan and len(new_plan.params) == 2
    engine.wait_until_finished()
    engine.close()


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
    from overlap_ckpt.core.capture import Outbox
    assert engine.submit(4, Outbox(ticket, [], [], [], [], [])) is False
    engine.close()
