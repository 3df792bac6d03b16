"""How a train step learns that it is in a checkpoint window, with nothing in the user's state.

A window step must compile differently from a plain step (one variant per window phase),
so the fact "the next step captures phase j" has to reach ``jax.jit``'s cache key. Carried
in the train state it was visible to everything that walks the state: ``nnx.state``,
``nnx.to_flat_state``, sharding reports, Flax's ``to_state_dict``. It rides instead in a
JAX *user context* (``jax.make_user_context``): a thread-local value that is part of every
``jit``/``pmap`` cache key and of the trace context, and of nothing the user can see.

The manager hands the next step its ticket after each step (:func:`hand_to_next_step`),
on the training thread, and takes it back (``None``) after the window. While a ticket is
out, other jitted functions the loop calls on that thread are keyed on it too: each
compiles at most once per window phase, then hits the cache in every later window.
Outside windows the value is ``None``, the key of the user's own program.

What reads the ticket: ``TrainState.apply_gradients`` and ``nnx.Optimizer.update`` of
:mod:`overlap_ckpt.doors`, at trace time, through :func:`current_ticket`.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

from .capture import WindowTicket

_TICKET = jax.make_user_context(default_value=None)


def current_ticket() -> WindowTicket | None:
    """The window ticket of the step being traced on this thread (None: a plain step)."""
    return _TICKET.value


def hand_to_next_step(ticket: WindowTicket | None) -> None:
    """Set the ticket the next step traced or dispatched on this thread runs with, until
    the next call.

    Not a ``with`` block: the manager sets it at the end of ``mngr.step`` and the user's
    own code calls the jitted step afterwards. Entering a fresh context sets the
    thread-local value without keeping a stack of earlier values to unwind.
    """
    _TICKET(ticket).__enter__()


@contextlib.contextmanager
def window_ticket(ticket: WindowTicket | None) -> Iterator[None]:
    """Trace, lower or compile a step as the window variant of ``ticket`` inside this block
    (ahead-of-time compiles: ``with window_ticket(t): train_step.lower(state, batch).compile()``)."""
    with _TICKET(ticket):
        yield
