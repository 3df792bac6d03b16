"""core.schedule: window arithmetic (the one owner of K) and which windows a run captures."""

import pytest
from hypothesis import given, strategies as st

from overlap_ckpt import ConfigError
from overlap_ckpt.core.schedule import WindowSchedule, WindowTracker


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


@given(interval=st.integers(1, 30), k=st.integers(1, 30), step=st.integers(0, 200))
def test_version_and_first_step_invert_phase(interval, k, step):
    s = WindowSchedule.clamped(interval, k)
    phase = s.phase(step)
    if phase is not None:
        version = s.version(step, phase)
        assert version == s.target(step) and s.first_step(version) + phase == step


def test_tracker_runs_every_window_but_captures_only_whole_ones():
    tracker = WindowTracker(WindowSchedule(4, 2), start_step=0)
    assert [tracker.phase(t) for t in range(9)] == [None, None, None, 0, 1, None, None, 0, 1]
    assert tracker.captures(3, 0) and tracker.captures(4, 1)
    tracker.restart(4)  # resumed at step 4: the window of 4 began at step 3, before this run
    assert tracker.phase(4) == 1 and not tracker.captures(4, 1)
    assert tracker.open_window(4) is None  # nothing of it is captured, nothing is lost
    assert tracker.captures(7, 0) and tracker.open_window(8) == 8


def test_tracker_exclusions_and_skips():
    tracker = WindowTracker(WindowSchedule(4, 2))
    tracker.exclude(8)  # saved synchronously: its window still runs, uncaptured
    assert tracker.phase(7) == 0 and not tracker.captures(7, 0) and not tracker.is_skipped(8)
    tracker.skip(12)  # no host memory: runs without copies
    assert tracker.is_skipped(12) and not tracker.captures(11, 0)
    for v in range(16, 4000, 4):  # long runs keep only recent versions
        tracker.skip(v)
    assert not tracker.is_skipped(12) and tracker.is_skipped(3996)
