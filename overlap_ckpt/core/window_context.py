"""How a train step learns that it is in a checkpoint window, with nothing in the user's state.

A window step must compile differently from a plain step (one variant per window phase),
so the fact "the next step captures phase j" has to reach ``jax.jit``'s cache key. Carried
in the train state it was visible to everything that walks the state: ``nnx.state``,
``nnx.to_flat_state``, sharding reports, Flax's ``to_state_dict``. It rides instead in a
JAX *user context* (``jax.make_user_context``): a thread-local value that is part of every
``jit``/``pmap`` cache key and of the trace context, and of nothing the user can see.

The value is the tuple of tickets handed out on this thread, one per manager in a window:
two managers (a GAN's two optimizers) can be in windows at once, and each update picks the
ticket planned for its own optax transformation (:func:`ticket_for`). The tuple lists the
managers in a fixed order, not in the order their windows began: in a loop that steps its
states at different rates (a WGAN's critic several times per generator step), the same
tickets come out in both orders, and each order was a key of its own that compiled the
same window variant again on the training thread. A manager hands the
next step its ticket after each step (:func:`hand_to_next_step`), on the training thread,
and takes it back (``None``) after the window. While a ticket is out, other jitted
functions the loop calls on that thread are keyed on it too: each compiles at most once
per window phase, then hits the cache in every later window. Outside windows the value is
``()``, the key of the user's own program.

What reads the tickets: ``TrainState.apply_gradients`` and ``nnx.Optimizer.update`` of
:mod:`overlap_ckpt.doors`, at trace time. The same module records which optax
transformations open managers plan (:func:`set_planned`), for checks a door makes outside
windows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref
from typing import Any, Iterator, Mapping

import jax

from .capture import lead_axes
from .plan import CapturePlan
from .schedule import WindowSchedule
from .ticket import WindowTicket

_TICKETS = jax.make_user_context(default_value=())
_HANDED = threading.local()  # .by_owner: WeakKeyDictionary {manager: its ticket}, this thread's
_PLANNED: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # {manager: its tx}


def window_tickets() -> tuple[WindowTicket, ...]:
    """The window tickets of the step being traced on this thread (empty: a plain step)."""
    return _TICKETS.value


def ticket_for(tx: Any) -> WindowTicket | None:
    """The ticket planned for the optax transformation ``tx``, if one is handed out.

    Its host copies get more leading unit axes than any leaf of the states in windows has
    (several, when several managers' states are updated in one step), so that ``jit``
    cannot pair a donated leaf of another with them (see :func:`overlap_ckpt.core.capture.to_host`).
    """
    tickets = _TICKETS.value
    for ticket in tickets:
        if ticket.plan.tx is tx:
            return dataclasses.replace(ticket, lead_axes=lead_axes([t.plan for t in tickets]))
    return None


def set_planned(owner: Any, tx: Any) -> None:
    """Record that ``owner`` (an open manager) checkpoints the updates of the optax
    transformation ``tx``; ``None`` when it no longer does (closed).

    Why, outside windows: an update that gets arguments the host replay cannot see is
    checked at the first step that passes them, before any window, but only for an
    optimizer a manager plans (the others must stay the framework's own). Held weakly, so
    a manager dropped without ``close()`` leaves nothing behind for long.
    """
    if tx is None:
        _PLANNED.pop(owner, None)
    else:
        _PLANNED[owner] = tx


def is_planned(tx: Any) -> bool:
    """Does an open manager checkpoint the updates of ``tx`` (see :func:`set_planned`)?"""
    return any(planned is tx for planned in list(_PLANNED.values()))


def hand_to_next_step(owner: Any, ticket: WindowTicket | None) -> None:
    """Set ``owner``'s ticket for the steps traced or dispatched next on this thread, until
    its next call (``None``: ``owner`` is not in a window).

    Not a ``with`` block: the manager sets it at the end of ``mngr.step`` and the user's
    own code calls the jitted step afterwards. Entering a fresh context sets the
    thread-local value without keeping a stack of earlier values to unwind. Owners are held
    weakly: a manager dropped without ``close()`` leaves no ticket behind for long.
    """
    by_owner = getattr(_HANDED, "by_owner", None)
    if by_owner is None:
        by_owner = _HANDED.by_owner = weakref.WeakKeyDictionary()
    if ticket is None:
        by_owner.pop(owner, None)
    else:
        by_owner[owner] = ticket
    _TICKETS(keyed(by_owner)).__enter__()


def handed_out() -> list[Any]:
    """The owners whose tickets :func:`hand_to_next_step` has out on this thread (the
    training thread's; a thread that compiles under :func:`window_ticket` has none)."""
    by_owner = getattr(_HANDED, "by_owner", None)
    return [] if by_owner is None else list(by_owner)


def keyed(tickets: Mapping[Any, WindowTicket]) -> tuple[WindowTicket, ...]:
    """The tickets of several owners as the step sees them: ordered by owner, a fixed order
    while the owners live, so the same tickets always make the same key."""
    return tuple(ticket for _, ticket in sorted(tickets.items(), key=lambda item: id(item[0])))


def shared_step_keys(own: Any, windows: Mapping[Any, tuple[WindowSchedule, CapturePlan]],
                     max_windows: int = 4096) -> list[tuple[WindowTicket, ...]]:
    """Every set of tickets a step runs under in ``own``'s windows, as :func:`keyed` orders
    them, when the step is shared by the owners of ``windows`` (owner: its schedule and plan;
    ``own`` among them, alone when nothing else shares its step).

    Why: each window step compiles for the tickets of every owner in a window at that step,
    so the variants of one owner alone are not those a shared step runs when windows meet.
    The owners' steps are assumed to be counted alike (one jitted step updates every state,
    as in a GAN); the combinations repeat with the least common multiple of the intervals,
    over which the first ``max_windows`` of ``own``'s windows are looked at.
    """
    schedule = windows[own][0]
    period = math.lcm(*(other.interval for other, _ in windows.values()))
    keys: dict[tuple[WindowTicket, ...], None] = {}
    for version in range(schedule.interval, min(period, schedule.interval * max_windows) + 1, schedule.interval):
        for step in range(schedule.first_step(version), version + 1):
            keys[keyed({owner: WindowTicket(plan, phase) for owner, (other, plan) in windows.items()
                        if (phase := other.phase(step)) is not None})] = None
    return list(keys)


@contextlib.contextmanager
def window_ticket(ticket: WindowTicket | tuple[WindowTicket, ...] | None) -> Iterator[None]:
    """Trace, lower or compile a step as the window variant of ``ticket`` (or of a tuple of
    several owners' tickets, from :func:`keyed`) inside this block (ahead-of-time compiles:
    ``with window_ticket(t): train_step.lower(state, batch).compile()``)."""
    with _TICKETS(() if ticket is None else ticket if isinstance(ticket, tuple) else (ticket,)):
        yield
