"""Window bookkeeping edge cases and the optimizers that must be refused before a window."""

import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings, strategies as st

from overlap_ckpt import ConfigError, MemorySink, OverlapEngine, UnsupportedOptimizerError, WindowSchedule
from overlap_ckpt.slicing import make_slicing

from conftest import check_windows, make_params, run_loop


@given(interval=st.integers(1, 30), k=st.integers(1, 30), step=st.integers(0, 200))
def test_schedule_phases(interval, k, step):
    if k > interval:
        with pytest.raises(ConfigError, match="does not fit a save interval"):
            WindowSchedule(interval, k)
        assert WindowSchedule.clamped(interval, k).k == interval
        return
    s = WindowSchedule(interval, k)
    phase = s.phase(step)
    if phase is None:
        assert all(s.target(step) is None for _ in [0])
    else:
        v = s.target(step)
        assert v % interval == 0 and v > 0 and v - k + 1 + phase == step and 0 <= phase < k


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 64)), min_size=1, max_size=12),
       st.integers(1, 9), st.booleans())
def test_slicing_tiles_every_leaf(units, k, chunkable):
    rows = [r for r, _ in units]
    row_bytes = [b for _, b in units]
    slicing = make_slicing(rows, row_bytes, k, chunkable)
    covered = {}
    for sl in slicing.slices:
        assert sl
        for p in sl:
            covered.setdefault(p.leaf, []).append((p.start, p.stop))
    for leaf, n in enumerate(rows):
        spans = sorted(covered[leaf])
        if not chunkable:
            assert spans == [(0, n)] or len(spans) == 1
            continue
        pos = 0
        for a, b in spans:
            assert a == pos
            pos = b
        assert pos == n
    assert slicing.k == min(k, sum(rows) if chunkable else len(rows))


def test_back_to_back_windows_k_equals_interval():
    _, sink, refs = run_loop(optax.adam(1e-2), make_params([(30, 4), (4,)]), window=4, interval=4, steps=17)
    assert sorted(sink.saved) == [4, 8, 12, 16]
    check_windows(sink, refs)


def test_window_larger_than_interval_is_clamped(caplog):
    engine = OverlapEngine(optax.sgd(0.1), MemorySink(), interval=3, window=5)
    assert engine.schedule.k == 3
    assert "clamped" in caplog.text
    engine.close()


def test_flattening_optimizer_is_refused_with_leaf_names():
    def mixing():
        def update(updates, state, params=None):
            flat = jnp.concatenate([u.ravel() for u in jax.tree.leaves(updates)])
            flat = flat - jnp.mean(flat)  # whitening over the concatenated vector
            out, i = [], 0
            for u in jax.tree.leaves(updates):
                out.append(flat[i:i + u.size].reshape(u.shape))
                i += u.size
            return jax.tree.unflatten(jax.tree.structure(updates), out), state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    engine = OverlapEngine(mixing(), MemorySink(), interval=4, window=2)
    params = make_params([(4, 3), (3,)])
    with pytest.raises(UnsupportedOptimizerError, match=r"params\['w00[01]'\]"):
        engine.plan_for(params, engine.tx.init(params))
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
