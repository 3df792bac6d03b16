"""manager.window_choice: what ``window="auto"`` keeps of the compiled schedules it reads.

The compile-ahead threads hand each compiled window phase to ``read_schedule``. When a
measured K re-plans the windows, a second job (the new plan's) compiles while the first
(the old plan's) may still run, so their readings arrive interleaved, on two threads.
Reference: the readings themselves, combined by hand (the least of a plan's phases).
"""

import itertools
import sys
import threading
import types

import pytest

from overlap_ckpt.costmodel.window import CompiledSchedule
from overlap_ckpt.manager import window_choice
from overlap_ckpt.manager.window_choice import AutoWindow, WindowChoice


@pytest.fixture
def readings(monkeypatch):
    """``read_schedule`` is given the reading itself in place of a compiled program."""
    monkeypatch.setattr(window_choice, "schedule_of", lambda compiled: compiled)


def adapting_choice() -> WindowChoice:
    """A choice whose K is still adapting: measured before any schedule was read, so it is
    chosen again once one is."""
    choice = WindowChoice("auto", interval_steps=20, persist_bytes_per_s=1e9)
    choice._unread = AutoWindow(20, 1e9)
    assert choice.adapting
    return choice


def plan(k: int):
    return types.SimpleNamespace(k=k)


def test_a_finished_plans_schedule_survives_the_old_plans_reading_between_its_phases(readings):
    """The order that left a CI run at the constant's K: the new plan's phase 0, the old
    plan's only phase, the new plan's phase 1. Before, each plan's reading wiped the other's,
    and the new plan ended with phase 1 alone, so no schedule was ever complete."""
    choice = adapting_choice()
    old, new = plan(1), plan(2)
    choice.read_schedule(new, 0, CompiledSchedule(0.30))
    choice.read_schedule(old, 0, CompiledSchedule(0.15))
    choice.read_schedule(new, 1, CompiledSchedule(0.20, overlapped_bytes=5e6))
    assert choice.schedule == CompiledSchedule(0.20, overlapped_bytes=5e6)  # the least of new's phases


def test_the_latest_plan_read_to_the_end_is_the_schedule(readings):
    choice = adapting_choice()
    old, new = plan(1), plan(2)
    choice.read_schedule(new, 0, CompiledSchedule(0.30))
    assert choice.schedule is None  # no plan read to the end yet
    choice.read_schedule(old, 0, CompiledSchedule(0.15))
    assert choice.schedule == CompiledSchedule(0.15)
    choice.read_schedule(new, 1, CompiledSchedule(0.25))
    assert choice.schedule == CompiledSchedule(0.25)


def test_variants_of_one_phase_give_their_tighter_reading(readings):
    """A step shared by two managers compiles several variants of a phase."""
    choice = adapting_choice()
    window = plan(1)
    choice.read_schedule(window, 0, CompiledSchedule(0.40))
    choice.read_schedule(window, 0, CompiledSchedule(0.60, overlapped_bytes=1e6))
    assert choice.schedule == CompiledSchedule(0.40, overlapped_bytes=1e6)


def test_readings_on_two_threads_at_once_are_all_kept(readings):
    """Two compile-ahead jobs read on their own threads: every phase read is counted. (The
    interpreter switches threads every microsecond here, so the two interleave.)"""
    choice = adapting_choice()
    plans = [plan(2000), plan(2000)]
    start = threading.Barrier(len(plans))

    def read(window, fraction):
        start.wait()
        for phase in range(window.k):
            choice.read_schedule(window, phase, CompiledSchedule(fraction + phase / 1000))

    threads = [threading.Thread(target=read, args=(p, f)) for p, f in zip(plans, (0.1, 0.5))]
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert choice.schedule in (CompiledSchedule(0.1), CompiledSchedule(0.5))


def test_nothing_is_kept_once_k_is_final(readings):
    choice = WindowChoice(2, interval_steps=20, persist_bytes_per_s=1e9)
    assert not choice.adapting
    choice.read_schedule(plan(1), 0, CompiledSchedule(0.15))
    assert choice.schedule is None


def test_a_reading_without_a_fraction_completes_no_phase(readings):
    """A phase whose program has no matmuls or no host copy tells nothing of the step."""
    choice = adapting_choice()
    window = plan(2)
    for phase, fraction in zip(range(2), itertools.repeat(None)):
        choice.read_schedule(window, phase, CompiledSchedule(fraction))
    assert choice.schedule is None
