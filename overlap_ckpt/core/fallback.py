"""Out-of-graph capture, for step functions overlap_ckpt cannot enter.

When the jitted step is opaque (it returns new params, opt_state and its gradients, but
does not call :func:`overlap_ckpt.capture_update`), the same outbox is built by two small
jitted programs around it:

* :func:`capture_before` runs *before* the step and copies slice ``j`` of the input state
  to pinned host memory. If the step donates its inputs, the runtime waits for these
  reads before reusing the buffers, so the copy is serialised with the step: each stall
  shrinks to 1/K of a full snapshot, but nothing is hidden behind compute. This is the
  cost of the fallback; in-graph capture hides the copy.
* :func:`capture_after` runs *after* the step and copies the gradient pieces. Optimizers
  with global scalars (clip_by_global_norm, apply_if_finite, lamb) need them recomputed
  from the step's inputs and gradients on the device, so those inputs must still be
  alive: do not donate them, or use in-graph capture.

The host replay is exact when the device applied the update as a program of its own
(for instance gradients from one jitted function, the update from another); a step that
fuses the backward pass into the update rounds differently (see docs/design.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from .capture import capture_extras, capture_grads, capture_state, recorded_update
from .ticket import Outbox, WindowTicket


@jax.jit
def _before(ticket: WindowTicket, params, opt_state, extras) -> Outbox:
    return capture_state(ticket, params, opt_state, extras)


@jax.jit
def _after(ticket: WindowTicket, grads, params, opt_state) -> tuple[list, list]:
    plan = ticket.plan
    cuts = recorded_update(plan, params, opt_state, grads)[-1] if plan.analysis.n_globals else []
    return capture_grads(ticket, grads, cuts)


@jax.jit
def capture_before_step(ticket: WindowTicket, extras) -> list:
    """The extras of the last phase, copied before the step that would change them.

    NNX models update their non-optimized state (batch statistics, RNG counters) in the
    forward pass, before ``optimizer.update`` runs, so in the step they are already those
    of the next version. The copy reads the step's inputs: if the step donates them, the
    runtime waits for it (the extras are small).
    """
    return capture_extras(ticket, extras)


def capture_before(ticket: WindowTicket, params, opt_state, extras: Any = None) -> Outbox:
    """Copy the ticket's slice of the input state; call before the step that reads it."""
    return _before(ticket, params, opt_state, extras)


def capture_after(outbox: Outbox, grads, params=None, opt_state=None) -> Outbox:
    """Add the step's gradient pieces (and global scalars) to ``outbox``; call after the step.

    ``params``/``opt_state`` are the step's *inputs*, needed only when the optimizer has
    global scalars.
    """
    ticket = outbox.ticket
    if ticket.last:
        return outbox
    if ticket.plan.analysis.n_globals and (params is None or any(
            getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves((params, opt_state)))):
        raise ValueError(
            "this optimizer needs global scalars (e.g. clip_by_global_norm) recomputed from the "
            "step's inputs, which were not given or were donated; pass the step's input params "
            "and opt_state without donating them, or capture in-graph with capture_update.")
    pieces, packed = _after(ticket, grads, params, opt_state)
    return dataclasses.replace(outbox, grads=pieces, globals=packed)
