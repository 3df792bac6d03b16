"""The per-step protocol between a manager and the jitted step: a window ticket handed out
before a step, the step's outbox taken back after it.

Why a unit of its own: the protocol is where a loop that calls ``mngr.step`` the wrong way
(twice, from another thread, with another optimizer's state) is caught, and it is the
manager's only per-step work in a window. The manager counts steps on the host after
reading the step number once, so nothing here waits on the device.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

from ..core.fallback import capture_before_step
from ..core.ticket import Outbox, WindowTicket
from ..core.window_context import hand_to_next_step
from .training_compiles import CompileReport


class Handoff:
    """One manager's tickets and outboxes. ``owner`` (the manager) keys its ticket in the
    window context, beside other managers' (:mod:`overlap_ckpt.core.window_context`);
    ``admit(step)`` admits the window starting at ``step`` under the host budget; ``ahead``
    (its :class:`~overlap_ckpt.manager.compile_ahead.CompileAhead`) compiles the window
    variants in the background, and a window step waits for them."""

    def __init__(self, owner: Any, ahead: Any, admit: Callable[[int], None]):
        self._owner = owner
        self._admit = admit  # admits a window under the host budget, at its first step
        self._ahead = ahead
        self._compiles = CompileReport(owner)  # variants compiled on the training thread instead
        self.next_step: int | None = None  # version of the input state of the next step
        self.sent: WindowTicket | None = None  # the ticket given to the next step
        self._extras: list | None = None  # extras copied before the next step (doors that need it)
        self.captured: collections.deque[int] = collections.deque(maxlen=16)  # versions whose capture completed

    def restart(self, step: int) -> None:
        """A (re)prepared state of version ``step``: a ticket out in the middle of a window
        is taken back."""
        self.next_step = step
        self.withdraw()

    def withdraw(self) -> None:
        """The next step is a plain step (no ticket)."""
        if self.sent is not None:
            hand_to_next_step(self._owner, None)
            self.sent = None

    def next_phase(self) -> int | None:
        """The window phase the next step captures (None: a plain step)."""
        return None if self.sent is None else self.sent.phase

    def open_window(self, engine: Any) -> int | None:
        """The version of a window the next step would continue (phase > 0), if any."""
        if engine is None or self.next_step is None:
            return None
        return engine.windows.open_window(self.next_step)

    def give(self, engine: Any, door: Any, state: Any, step: int) -> None:
        """Give the step whose input is ``state`` (version ``step``) its ticket, if any: at
        a window's first phase after re-planning and admitting it, at every phase once its
        variant compiled ahead is ready."""
        phase = engine.phase(step)
        if phase is None:
            self.withdraw()
            return
        if phase == 0:
            parts = door.parts(state)
            engine.plan_for(parts.params, parts.opt_state, parts.extras)  # re-plans if the tree changed
            if engine.phase(step) == 0 and engine.windows.captures(step, 0):  # the plan may lower K
                self._admit(step)
        self._ahead.await_variants()
        ticket = engine.ticket(step)
        self.sent = ticket
        self._extras = None
        if ticket.last and ticket.capture and not door.extras_in_step and engine.windows.captures(step, ticket.phase):
            self._extras = capture_before_step(ticket, door.parts(state).extras)
        hand_to_next_step(self._owner, ticket)

    def take(self, engine: Any, door: Any, state: Any) -> Any:
        """After the step that produced ``state``: hand its outbox (if it was given a
        ticket) to ``engine``; returns the state without it."""
        sent, t = self.sent, self.next_step
        if sent is not None:
            outbox, state = door.take_outbox(state)
            self._check(t, sent, outbox)
            if self._extras is not None:
                outbox = dataclasses.replace(outbox, extras=self._extras)
            if engine.submit(t, outbox, {"framework": door.name, "window": sent.plan.k}) and sent.last:
                self.captured.append(engine.schedule.version(t, sent.phase))
            if sent.last:
                self._compiles.after_window(compiled_ahead=self._ahead.call is not None)
        self.next_step = t + 1
        return state

    @staticmethod
    def _check(t: int, sent: WindowTicket, outbox: Any) -> None:
        if outbox is None:
            raise RuntimeError(
                f"step {t} is in phase {sent.phase} of a checkpoint window but the state carries no "
                "outbox: call CheckpointManager.step exactly once per training step, on the thread "
                "that runs the step, with the state returned by a step that called apply_gradients "
                "(NNX: optimizer.update) with the optimizer this manager prepared.")
        if not isinstance(outbox, Outbox) or outbox.ticket != sent:
            raise RuntimeError(f"the outbox of step {t} is not the one this manager asked for "
                               f"(phase {getattr(getattr(outbox, 'ticket', None), 'phase', '?')}, "
                               f"expected {sent.phase})")
