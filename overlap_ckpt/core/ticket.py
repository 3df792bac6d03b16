"""What a window step is told and what it hands back: the :class:`WindowTicket` a manager
gives the next step, and the :class:`Outbox` of host copies the step returns with its state.

Apart from :mod:`overlap_ckpt.core.capture`, which makes outboxes, because everything on the
way reads them (the doors, the window context, the engine, the compile-only checks) and
none of those should import the capture's tracing machinery to name a type.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from . import packing
from .packing import Packing
from .plan import CapturePlan


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class WindowTicket:
    """Tells a train step to capture ``phase`` of a window planned by ``plan``."""

    plan: CapturePlan
    phase: int
    capture: bool = True  # False: run the window's update, copy nothing (a skipped window)
    # Unit axes put in front of every host copy (see :func:`to_host`): set at trace time by
    # window_context.ticket_for to cover every state in a window in that step; 0 (the
    # functional core's tickets): what the plan's own leaves need. Not part of the ticket's
    # identity: the manager matches the outbox against the ticket it sent.
    lead_axes: int = dataclasses.field(default=0, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.phase < self.plan.k:
            raise ValueError(f"window phase {self.phase} outside 0..{self.plan.k - 1}")

    @property
    def last(self) -> bool:
        return self.phase == self.plan.k - 1

    def __repr__(self) -> str:
        return (f"WindowTicket(phase {self.phase} of {self.plan.k}"
                f"{'' if self.capture else ', no capture'}, {self.plan!r})")


@dataclasses.dataclass
class Outbox:
    """The host copies one window step produced (see the module docstring).

    With a packed outbox (:mod:`overlap_ckpt.core.packing`, GPU and TPU) the captured arrays
    are in ``packed``, one host copy per element width and group, and ``packing`` says which
    lists they belong to; the lists then hold only the items not packed (on TPU, the large
    ones), in item order. :func:`unpacked` gives back full lists.
    """

    ticket: WindowTicket
    state: list[jax.Array]
    shared: list[jax.Array]
    grads: list[jax.Array]
    globals: list[jax.Array]
    extras: list[jax.Array]
    packed: list[jax.Array] = dataclasses.field(default_factory=list)
    packing: Packing | None = None

    def map(self, fn: Callable[[jax.Array], Any]) -> "Outbox":
        """The same outbox with ``fn`` applied to every array (a door's view of its arrays)."""
        return jax.tree.map(fn, self)


jax.tree_util.register_dataclass(Outbox, data_fields=["state", "shared", "grads", "globals", "extras", "packed"],
                                 meta_fields=["ticket", "packing"])


def unpacked(outbox: Outbox) -> Outbox:
    """``outbox`` with its packed host copies cut back into the per-leaf lists an unpacked
    outbox carries (views, no copy), merged in item order with the items copied on their
    own (:func:`overlap_ckpt.core.packing.selected`); an unpacked outbox as it is."""
    layout = outbox.packing
    if layout is None:
        return outbox
    plan, phase = outbox.ticket.plan, outbox.ticket.phase
    items = packing.phase_items(plan, phase, layout.extras)
    state_items = items.state_items()
    packed_state = [item for item, packed in zip(state_items, packing.selected(plan, state_items)) if packed]
    n_state = len(packing.groups(packed_state))
    own = [*outbox.state, *outbox.shared, *(outbox.extras if layout.extras else [])]
    arrays = iter(packing.merge(plan, state_items, outbox.packed[:n_state], own))
    parts = {name: [next(arrays) for _ in entries] for name, entries in items.parts()}
    grads = (packing.merge(plan, packing.grad_items(plan, phase), outbox.packed[n_state:], outbox.grads)
             if layout.grads else outbox.grads)
    return dataclasses.replace(outbox, state=parts["state"], shared=parts["shared"], grads=grads,
                               extras=parts["extras"] if layout.extras else outbox.extras,
                               packed=[], packing=None)
