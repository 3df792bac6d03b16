"""Properties of the checkpoint cost model and the automatic window-size choice."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from overlap_ckpt.costmodel import (
    GB,
    TrainingProfile,
    choose_k,
    estimate,
    measure_d2h_bandwidth,
    min_zero_stall_k,
    predict_ettr,
    predict_stall_s,
    window_transfer_bytes,
)
from overlap_ckpt.core.slicing import slice_shares
from overlap_ckpt.tools.simulate import HARDWARE_PRESETS, format_simulation_table, simulate

from conftest import step_copies

FAST = settings(max_examples=60, deadline=None)


def make(state=16.0, grad=2.0, budget=None, *, step=1.0, frac=1.0, bw=1.0, persist=1e9,
         replay=None) -> TrainingProfile:
    """A profile in convenient units: with ``step=frac=bw=1`` bytes equal seconds and
    ``budget`` (bytes one step hides) sets the step time."""
    if budget is not None:
        step = budget / (frac * bw)
    return TrainingProfile(step_time_s=step, d2h_bytes_per_s=bw, state_bytes=state,
                           grad_bytes=grad, persist_bytes_per_s=persist,
                           overlappable_fraction=frac, replay_bytes_per_s=replay)


profiles = st.builds(
    TrainingProfile,
    step_time_s=st.floats(1e-3, 10.0),
    d2h_bytes_per_s=st.floats(1e8, 1e11),
    state_bytes=st.floats(1e6, 1e11),
    grad_bytes=st.floats(0.0, 2e10),
    persist_bytes_per_s=st.floats(1e8, 1e10),
    overlappable_fraction=st.floats(0.0, 1.0),
)
ks = st.integers(1, 40)


# ---------------------------------------------------------------- per-step traffic


def shipped_by_slices(state: float, grad: float, k: int) -> list[float]:
    """What each window step ships, from the slices the engine cuts (slice_shares): slice
    j and the gradient rows of slices 0..j at step j < k-1, the last slice alone at the
    end. The reference for the model's closed form."""
    g = grad / state if state else 0.0
    return [state * c for c in step_copies(slice_shares(k, g), g)]


@FAST
@given(state=st.floats(1.0, 1e12), grad=st.floats(0.0, 1e12), k=ks)
def test_window_steps_ship_what_the_slices_hold_and_the_same_each(state, grad, k):
    per_step = window_transfer_bytes(state, grad, k)
    assert len(per_step) == k
    for model, slices in zip(per_step, shipped_by_slices(state, grad, k)):
        assert model == pytest.approx(slices, rel=1e-9)
    # Never more per step than equal slices ship at their largest step.
    assert per_step[0] <= (state + (k - 1) * grad) / k * (1 + 1e-12)
    # Never less than the gradient rows of everything before the last slice.
    assert per_step[0] >= state * grad / (state + grad) * (1 - 1e-12)


def test_window_traffic_small_example():
    # S=12, G=4 (g = 1/3), K=2: slices of 3/7 and 4/7 of the state. Step 0 ships
    # 12*3/7 + 4*3/7 = 48/7, step 1 the last slice, 12*4/7 = 48/7. Equal slices (6 + 6)
    # would ship 6 + 2 = 8 at step 0.
    assert window_transfer_bytes(12, 4, 2) == pytest.approx([48 / 7, 48 / 7], rel=1e-12)
    assert window_transfer_bytes(12, 0, 3) == pytest.approx([4, 4, 4], rel=1e-12)


# ---------------------------------------------------------------- stall model


@FAST
@given(profiles)
def test_overlap_k1_is_copy_minus_overlappable_time(p):
    expected = max(0.0, p.state_bytes / p.d2h_bytes_per_s
                   - p.overlappable_fraction * p.step_time_s)
    assert predict_stall_s(p, "overlap", 1) == pytest.approx(expected, rel=1e-12, abs=1e-15)


@FAST
@given(profiles)
def test_baselines_formulas_and_order(p):
    copy = p.state_bytes / p.d2h_bytes_per_s
    assert predict_stall_s(p, "async") == pytest.approx(copy)
    assert predict_stall_s(p, "sync") == pytest.approx(copy + p.state_bytes
                                                       / p.persist_bytes_per_s)
    assert (predict_stall_s(p, "sync") >= predict_stall_s(p, "async")
            >= predict_stall_s(p, "overlap", 1) >= 0)


@FAST
@given(profiles, ks)
def test_overlap_stall_is_sum_of_per_step_excess_and_bounded(p, k):
    stall = predict_stall_s(p, "overlap", k)
    hide = p.overlappable_fraction * p.step_time_s
    excess = [max(0.0, b / p.d2h_bytes_per_s - hide)
              for b in window_transfer_bytes(p.state_bytes, p.grad_bytes, k)]
    assert stall == pytest.approx(sum(excess), rel=1e-9, abs=1e-12)
    total = math.fsum(shipped_by_slices(p.state_bytes, p.grad_bytes, k)) / p.d2h_bytes_per_s
    # Cannot beat "all bytes minus all hidden time", cannot exceed "nothing hidden".
    assert max(0.0, total - k * hide) - 1e-9 * total <= stall <= total * (1 + 1e-12)


@FAST
@given(profiles, ks, st.floats(0.0, 1.0))
def test_a_schedule_that_serialized_copies_caps_the_bytes_a_step_hides(p, k, share):
    """Where a compiled step overlapped only ``C`` bytes of its copies and serialized the
    rest, a window step hides at most ``C`` whatever its time says; every byte beyond
    transfers with the step waiting. Reference: each step's bytes from the slices the
    engine cuts, against the lesser of the two budgets."""
    capacity = share * p.state_bytes
    capped = dataclasses.replace(p, schedule_capacity_bytes=capacity)
    budget = min(p.overlappable_fraction * p.step_time_s * p.d2h_bytes_per_s, capacity)
    shipped = shipped_by_slices(p.state_bytes, p.grad_bytes, k)
    want = math.fsum(max(0.0, b - budget) for b in shipped) / p.d2h_bytes_per_s
    tol = 1e-9 * math.fsum(shipped) / p.d2h_bytes_per_s
    assert predict_stall_s(capped, "overlap", k) == pytest.approx(want, rel=1e-9, abs=tol)
    assert predict_stall_s(capped, "overlap", k) >= predict_stall_s(p, "overlap", k) - tol


def test_a_k1_step_whose_schedule_serialized_copies_moves_auto_to_a_k_whose_steps_fit():
    """The 100M LM at 2 sequences per v5e chip, in round figures: a step's time would hide
    the whole state, but XLA:TPU overlapped only 72% of K=1's copies and serialized the
    rest. K=2's steps each carry 4/7 of the state (G = S/3), which fits: no stall."""
    s, g = 300e6, 100e6
    time_hides_all = make(s, g, budget=2 * s)
    assert choose_k(time_hides_all) == 1 and predict_stall_s(time_hides_all, "overlap", 1) == 0
    serialized = dataclasses.replace(time_hides_all, schedule_capacity_bytes=0.72 * s)
    assert predict_stall_s(serialized, "overlap", 1) == pytest.approx(0.28 * s)  # bw = 1 byte/s
    assert window_transfer_bytes(s, g, 2)[0] == pytest.approx(4 / 7 * s)
    assert predict_stall_s(serialized, "overlap", 2) == 0
    assert choose_k(serialized) == 2 and choose_k(serialized, interval_steps=50) == 2
    with pytest.raises(ValueError, match="schedule_capacity_bytes"):
        dataclasses.replace(time_hides_all, schedule_capacity_bytes=-1.0)


@FAST
@given(profiles, ks, st.floats(1.0, 100.0))
def test_stall_monotone_in_resources_and_sizes(p, k, factor):
    base = predict_stall_s(p, "overlap", k)
    tol = 1e-9 * (p.state_bytes + p.grad_bytes * k) / p.d2h_bytes_per_s
    faster = dataclasses.replace(p, d2h_bytes_per_s=p.d2h_bytes_per_s * factor)
    longer = dataclasses.replace(p, step_time_s=p.step_time_s * factor)
    bigger = dataclasses.replace(p, state_bytes=p.state_bytes * factor)
    more_grad = dataclasses.replace(p, grad_bytes=p.grad_bytes * factor)
    assert predict_stall_s(faster, "overlap", k) <= base + tol
    assert predict_stall_s(longer, "overlap", k) <= base + tol
    assert predict_stall_s(bigger, "overlap", k) >= base - tol
    assert predict_stall_s(more_grad, "overlap", k) >= base - tol


@FAST
@given(profiles, ks)
def test_limits(p, k):
    # Nothing overlappable: every byte of the window stalls.
    none = dataclasses.replace(p, overlappable_fraction=0.0)
    assert predict_stall_s(none, "overlap", k) == pytest.approx(
        math.fsum(shipped_by_slices(p.state_bytes, p.grad_bytes, k)) / p.d2h_bytes_per_s)
    # Without gradients, K steps hide K times as much: stall = max(0, S/bw - K f T).
    nograd = dataclasses.replace(p, grad_bytes=0.0)
    assert predict_stall_s(nograd, "overlap", k) == pytest.approx(
        max(0.0, p.full_copy_s - k * p.overlap_s), rel=1e-9, abs=1e-9 * p.full_copy_s)
    # An infinitely fast link (in the limit) stalls nothing whenever anything overlaps.
    assume(p.overlappable_fraction > 1e-6)
    huge = dataclasses.replace(p, d2h_bytes_per_s=1e30)
    assert predict_stall_s(huge, "overlap", k) == 0.0


# ---------------------------------------------------------------- choose_k


@FAST
@given(profiles, st.integers(1, 24))
def test_choose_k_is_smallest_minimiser(p, max_k):
    k = choose_k(p, max_k=max_k)
    stalls = [predict_stall_s(p, "overlap", j) for j in range(1, max_k + 1)]
    best = min(stalls)
    tol = 1e-9 * p.full_copy_s
    assert 1 <= k <= max_k
    assert stalls[k - 1] <= best + tol
    assert all(s > best + tol for s in stalls[: k - 1])


@FAST
@given(profiles)
# A subnormal overlappable fraction: S/B overflows a float (found by hypothesis: OverflowError),
# without and with a gradient (a math domain error then).
@example(p=TrainingProfile(step_time_s=1.0, d2h_bytes_per_s=1e8, state_bytes=1e6, grad_bytes=0.0,
                           persist_bytes_per_s=1e8, overlappable_fraction=5e-324))
@example(p=TrainingProfile(step_time_s=1.0, d2h_bytes_per_s=1e8, state_bytes=1e6, grad_bytes=1e-316,
                           persist_bytes_per_s=1e8, overlappable_fraction=5e-324))
def test_choose_k_matches_closed_form_threshold(p):
    s, g, b = p.state_bytes, p.grad_bytes, p.transfer_budget_bytes
    k_star = min_zero_stall_k(p)
    if k_star is None:
        # Budget at or below the gradient stream a step must carry (and below the state):
        # never free.
        assert b <= s * g / (s + g) * (1 + 1e-9) and b < s
        assert predict_stall_s(p, "overlap", 64) > 0
        return
    # The definition, on the slices themselves: every step fits at k*, not at k*-1.
    if k_star <= 10**5:
        assert max(shipped_by_slices(s, g, k_star)) <= b * (1 + 1e-9)
        if k_star > 1:
            assert max(shipped_by_slices(s, g, k_star - 1)) > b * (1 - 1e-9)
    if k_star <= 10**6:
        assert predict_stall_s(p, "overlap", k_star) <= 1e-9 * p.full_copy_s
    if k_star <= 32:
        k = choose_k(p, max_k=32)
        assert k <= k_star
        if k < k_star:  # only on the boundary, where the float stall is ~0 at k
            assert predict_stall_s(p, "overlap", k) <= 1e-9 * p.full_copy_s


def test_choose_k_is_one_when_a_step_hides_the_copy():
    p = make(state=16, grad=2, budget=16.0)
    assert predict_stall_s(p, "overlap", 1) == 0
    assert choose_k(p) == 1
    assert choose_k(make(state=16, grad=2, budget=100.0), max_k=64) == 1


def test_choose_k_above_one_when_a_step_cannot_hide_the_copy():
    p = make(state=16, grad=2, budget=8.0)  # half the state per step
    k = choose_k(p)
    assert k > 1
    assert predict_stall_s(p, "overlap", k) < predict_stall_s(p, "overlap", 1)


def test_gockpt_regime_needs_fewer_steps_than_equal_slices():
    # Mixed-precision Adam: 16 B/param of state, bf16 gradient 2 B/param, a step hiding
    # twice the gradient (4 B/param). Equal slices ship (16 + 2(K-1))/K at their largest
    # step, which fits only at K = S/G - 1 = 7 (GoCkpt's K). Slices sized so every step
    # ships the same (g = 1/8) ship 16/(1 + 8(1 - (8/9)^(K-1))): 4.74 at K=4, 3.99 at K=5.
    assert max(shipped_by_slices(16.0, 2.0, 4)) > 4.0 >= max(shipped_by_slices(16.0, 2.0, 5))
    assert choose_k(make(state=16.0, grad=2.0, budget=4.0)) == 5
    assert (16 + 2 * 5) / 6 > 4.0 >= (16 + 2 * 6) / 7  # equal slices: 7


def test_budget_of_only_a_seventh_of_state_needs_a_long_window():
    # If a step hides only S/7 bytes (S=112, G=14, B=16), the gradient rows each step
    # carries eat most of it: (9/8)^-(K-1) <= 1 - (7 - 1)/8 = 1/4 first at K = 13, so the
    # choice is pinned to max_k below that while the stall keeps falling.
    p = make(state=112.0, grad=14.0, budget=16.0)
    assert min_zero_stall_k(p) == 13
    assert choose_k(p, max_k=8) == 8
    assert choose_k(p, max_k=64) == 13
    assert predict_stall_s(p, "overlap", 8) < predict_stall_s(p, "overlap", 4)


def test_interior_minimum_when_budget_is_below_the_gradient():
    # fp32 gradients (4 B/param) with a budget of S/7, below the S*G/(S+G) = 3.2 every
    # step carries as K grows: more steps first help, then K steps of excess dominate;
    # the best window is K=6.
    p = make(state=16.0, grad=4.0, budget=16 / 7)
    assert min_zero_stall_k(p) is None
    k = choose_k(p, max_k=40)
    assert k == 6
    stalls = [predict_stall_s(p, "overlap", j) for j in range(1, 41)]
    assert stalls[k - 1] == pytest.approx(min(stalls))
    assert stalls[-1] > stalls[k - 1]


def test_choose_k_clamped_to_interval():
    p = make(state=112.0, grad=14.0, budget=16.0)  # B = S/7: wants 49 steps
    assert choose_k(p, max_k=64, interval_steps=10) == 10
    assert choose_k(p, max_k=64, interval_steps=1) == 1
    assert choose_k(p, max_k=8, interval_steps=50) == 8
    k = choose_k(p, max_k=64, interval_steps=10)
    predict_ettr(p, "overlap", k, 10)  # the choice is always a valid window


def test_choose_k_with_interval_accounts_for_background_queueing():
    # Slow host replay: a longer window saves stall but its replay work no longer fits
    # between checkpoints; the interval-aware choice maximises ETTR instead of
    # minimising the stall alone.
    p = make(state=16.0, grad=2.0, budget=4.0, persist=1e9, replay=1.0)
    n = 10
    k_stall = choose_k(p, max_k=10)
    k_ettr = choose_k(p, max_k=10, interval_steps=n)
    assert k_ettr < k_stall
    ettrs = [predict_ettr(p, "overlap", j, n) for j in range(1, n + 1)]
    assert predict_ettr(p, "overlap", k_ettr, n) == pytest.approx(max(ettrs))


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_k=0), "max_k"),
    (dict(max_k=2.5), "max_k"),
    (dict(interval_steps=0), "interval_steps"),
    (dict(interval_steps=-3), "interval_steps"),
    (dict(max_k=True), "max_k"),
])
def test_choose_k_rejects_nonsense(kwargs, match):
    with pytest.raises(ValueError, match=match):
        choose_k(make(budget=4.0), **kwargs)


# ---------------------------------------------------------------- ETTR


@FAST
@given(profiles, st.sampled_from(["sync", "async", "overlap"]), ks, st.integers(1, 200))
def test_ettr_bounds_and_monotone_in_interval(p, strategy, k, n):
    assume(strategy != "overlap" or k <= n)
    e = predict_ettr(p, strategy, k, n)
    assert 0 < e <= 1
    assert predict_ettr(p, strategy, k, n + 10) >= e - 1e-12


def test_ettr_formulas():
    p = make(state=16.0, grad=2.0, budget=4.0, persist=2.0)  # step 4 s, persist 8 s
    # sync: stall 16 + 8, no background.
    assert predict_ettr(p, "sync", 1, 10) == pytest.approx(40 / (40 + 24))
    # async: stall 16, persist 8 s fits in 10 steps (40 s).
    assert predict_ettr(p, "async", 1, 10) == pytest.approx(40 / 56)
    # async every step: persist 8 s > gap 4 s -> waits 4 s each time.
    est = estimate(p, "async", 1, 1)
    assert est.queue_wait_s == pytest.approx(4.0)
    assert est.ettr == pytest.approx(4 / (4 + 16 + 4))
    # overlap K=7 hides everything; persist fits in (10-7)*4 = 12 s.
    assert predict_stall_s(p, "overlap", 7) == 0
    assert predict_ettr(p, "overlap", 7, 10) == 1.0
    # K = interval leaves no gap: the whole persist queues.
    assert estimate(p, "overlap", 10, 10).queue_wait_s == pytest.approx(8.0)


def test_ettr_rejects_window_longer_than_interval():
    with pytest.raises(ValueError, match="exceeds the checkpoint interval"):
        predict_ettr(make(budget=4.0), "overlap", 8, 5)
    with pytest.raises(ValueError, match="strategy"):
        predict_ettr(make(budget=4.0), "orbax", 1, 5)


@pytest.mark.parametrize("field, value", [
    ("step_time_s", 0.0), ("step_time_s", -1.0), ("d2h_bytes_per_s", 0.0),
    ("state_bytes", 0.0), ("grad_bytes", -1.0), ("persist_bytes_per_s", float("nan")),
    ("overlappable_fraction", 1.5), ("overlappable_fraction", -0.1),
    ("replay_bytes_per_s", 0.0), ("state_bytes", float("inf")), ("step_time_s", True),
])
def test_profile_rejects_nonsense(field, value):
    kwargs = dict(step_time_s=1.0, d2h_bytes_per_s=1.0, state_bytes=1.0, grad_bytes=1.0,
                  persist_bytes_per_s=1.0)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        TrainingProfile(**kwargs)


# ---------------------------------------------------------------- measurement


def test_measure_d2h_bandwidth_on_cpu():
    import jax

    bw = measure_d2h_bandwidth(nbytes=1 << 20, repeats=2)
    assert math.isfinite(bw) and bw > 0
    bw = measure_d2h_bandwidth(jax.devices()[0], nbytes=1 << 16, repeats=1)
    assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValueError, match="nbytes"):
        measure_d2h_bandwidth(nbytes=0)


# ---------------------------------------------------------------- planning


def test_presets_are_documented_assumptions():
    assert HARDWARE_PRESETS["h100-pcie5"].d2h_bytes_per_s == 50 * GB
    assert HARDWARE_PRESETS["a100-pcie4"].d2h_bytes_per_s == 25 * GB
    for preset in HARDWARE_PRESETS.values():
        assert preset.persist_bytes_per_s == 5 * GB
        assert "override" in preset.note


@pytest.mark.parametrize("params, n, step", [(7e9, 8, 0.1), (7e9, 64, 1.0),
                                             (70e9, 64, 0.5), (70e9, 512, 2.0)])
def test_simulate_rows_are_sensible(params, n, step):
    rows = simulate(params, n, step_time_s=step)
    assert [r.label for r in rows] == ["sync save", "async snapshot", "overlap K=1",
                                       "overlap auto-K"]
    sync, asyn, k1, auto = rows
    for r in rows:
        assert r.intervals == (10, 50)
        assert r.state_bytes == pytest.approx(params * 16 / n)
        assert r.grad_bytes == pytest.approx(params * 2 / n)
        assert all(0 < e <= 1 for e in r.ettr)
        assert r.ettr_at(50) >= r.ettr_at(10)
    assert sync.stall_s[0] > asyn.stall_s[0] >= k1.stall_s[0]
    assert all(s <= k1.stall_s[0] + 1e-12 for s in auto.stall_s)
    assert all(k <= n_ for k, n_ in zip(auto.k, auto.intervals))
    assert all(a >= b - 1e-12 for a, b in zip(auto.ettr, k1.ettr))
    assert asyn.stall_s[0] == pytest.approx(params * 16 / n / (50 * GB))


def test_simulate_short_steps_need_a_window():
    # 7B over 8 H100s: 14 GB of state per GPU = 0.28 s of copy, 90 ms hidden per step.
    auto = simulate(7e9, 8, step_time_s=0.1, persist_gbps=1e3)[3]
    k1 = simulate(7e9, 8, step_time_s=0.1, persist_gbps=1e3)[2]
    assert all(k > 1 for k in auto.k)
    assert max(auto.stall_s) < k1.stall_s[0]


def test_simulate_rejects_and_overrides():
    with pytest.raises(ValueError, match="unknown hardware preset"):
        simulate(7e9, 8, step_time_s=1.0, hardware="tpu-v9")
    with pytest.raises(ValueError, match="n_accelerators"):
        simulate(7e9, 0, step_time_s=1.0)
    slow = simulate(7e9, 8, step_time_s=1.0, d2h_gbps=10)[1]
    assert slow.stall_s[0] == pytest.approx(14e9 / 10e9)


def test_format_simulation_table():
    rows = simulate(7e9, 8, step_time_s=0.1) + simulate(70e9, 64, step_time_s=1.0)
    table = format_simulation_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert "ETTR @10" in lines[0] and "ETTR @50" in lines[0]
    assert "| 7B | 8 |" in lines[2] and "| 70B | 64 |" in lines[-1]
    assert "overlap auto-K" in table
    assert format_simulation_table([]) == ""
