"""CompileAhead's hand-offs with the training thread, without a manager or a model.

The step is a stand-in whose ``lower().compile()`` records which window ticket it was
lowered under, on which thread, and can be held or made to fail: what is checked is the
protocol (when compiles may start, what a window step waits for, how a failure reaches the
training thread), which the manager tests see only through whole loops.
"""

from __future__ import annotations

import threading

import pytest

from overlap_ckpt.manager.compile_ahead import AheadCall, AheadJob, CompileAhead
from overlap_ckpt.core.window_context import window_tickets
from overlap_ckpt.errors import ConfigError


class RecordingStep:
    """A jitted step as compile_ahead uses it: ``lower(*args).compile()``."""

    def __init__(self, fail_on=None, hold: threading.Event | None = None):
        self.lowered: list[tuple] = []  # (tickets in effect, thread name) per lowering
        self.fail_on = fail_on
        self.hold = hold  # each compile waits for it
        self.compiling = threading.Event()  # a compile has started

    def lower(self, *args, **kwargs):
        tickets = window_tickets()
        self.lowered.append((tickets, threading.current_thread().name))
        if tickets and tickets[0] == self.fail_on:
            raise ValueError(f"cannot compile {self.fail_on}")
        return self

    def compile(self):
        self.compiling.set()
        if self.hold is not None:
            self.hold.wait(30)
        return self


def started(fn) -> threading.Thread:
    """``fn`` running in a thread of its own, 0.2 s after it started."""
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(0.2)
    return thread


def job(step, tickets, plan="plan"):
    return AheadJob(AheadCall(step, (), {}), plan, list(tickets))


def test_nothing_compiles_before_the_first_step_then_every_variant_before_the_replay():
    step, replays = RecordingStep(), []
    ahead = CompileAhead(replays.append)
    ahead.give(AheadCall(step, (), {}), live=None)
    thread = ahead.start(None)  # given before the first step: the job is read at that step
    thread.join(0.2)
    assert thread.is_alive() and step.lowered == [], "a compile started before the first step"
    ahead.first_step(job(step, ["phase-0", "phase-1"]))
    thread.join(30)
    assert [t for t, _ in step.lowered] == [("phase-0",), ("phase-1",)]
    assert {name for _, name in step.lowered} == {"overlap-ckpt-compile-ahead"}
    assert replays == ["plan"]
    ahead.raise_failure()  # nothing failed: nothing raised
    ahead.close()


def test_a_window_step_waits_for_the_variants_but_not_for_the_replay():
    variant_may_finish, replay_may_finish = threading.Event(), threading.Event()
    step = RecordingStep(hold=variant_may_finish)
    ahead = CompileAhead(lambda plan: replay_may_finish.wait(30))
    ahead.first_step(None)
    thread = ahead.start(job(step, ["phase-0"]))
    waited = started(ahead.await_variants)
    assert waited.is_alive(), "a window step went on while its variant was compiling"
    variant_may_finish.set()
    waited.join(30)
    assert not waited.is_alive(), "a window step waited for the host replay's compile"
    replay_may_finish.set()
    thread.join(30)
    ahead.close()


def test_a_variant_that_fails_to_compile_is_raised_once_by_the_training_thread():
    step = RecordingStep(fail_on="phase-1")
    ahead = CompileAhead(lambda plan: pytest.fail("the replay compiled after a failed variant"))
    ahead.first_step(None)
    ahead.start(job(step, ["phase-0", "phase-1", "phase-2"])).join(30)
    ahead.await_variants()  # a failure does not leave a window step waiting
    with pytest.raises(ConfigError, match="does not compile.*cannot compile phase-1") as raised:
        ahead.raise_failure()
    assert isinstance(raised.value.__cause__, ValueError)
    assert [t for t, _ in step.lowered] == [("phase-0",), ("phase-1",)]  # stopped at the failure
    ahead.raise_failure()  # reported once
    ahead.close()


def test_closing_before_the_first_step_ends_the_waiting_compile_without_compiling():
    step = RecordingStep()
    ahead = CompileAhead(lambda plan: pytest.fail("compiled after close"))
    ahead.give(AheadCall(step, (), {}), live=None)
    thread = ahead.start(None)
    closing = started(ahead.close)  # joins the compile thread
    closing.join(30)
    assert not closing.is_alive(), "close waits for a compile that waits for a first step"
    assert not thread.is_alive() and step.lowered == []


def test_closing_during_a_compile_waits_for_it_and_compiles_no_further_variant():
    may_finish = threading.Event()
    step = RecordingStep(hold=may_finish)
    ahead = CompileAhead(lambda plan: pytest.fail("compiled the replay after close"))
    ahead.first_step(None)
    thread = ahead.start(job(step, ["phase-0", "phase-1"]))
    assert step.compiling.wait(30)
    closing = started(ahead.close)
    assert closing.is_alive(), "close returned in the middle of a compile"
    may_finish.set()
    closing.join(30)
    assert not thread.is_alive() and [t for t, _ in step.lowered] == [("phase-0",)]
