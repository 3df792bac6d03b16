"""A user's own jitted step and train state, compiled for a target: the window variants
come from the window context the doors read (``overlap_ckpt.core.window_context``), as
``CheckpointManager.compile_ahead`` makes them, so the step is exactly the user's."""

from __future__ import annotations

from typing import Any

import jax

from ..core import backend
from ..core.ticket import WindowTicket
from ..core.engine import MemorySink, OverlapEngine
from ..core.plan import CapturePlan, make_plan
from ..core.window_context import window_ticket
from ..doors.registry import door_for
from .window import LowerStep


def plan_state(state: Any, k: int, *, pack_outbox: bool | None = None, rehearse: bool = True,
               **door_args: Any) -> CapturePlan:
    """The plan a manager would make for ``state`` (an ``overlap_ckpt.TrainState``, ...)
    with windows of ``k`` steps; its leaves may be abstract (``jax.ShapeDtypeStruct`` with
    shardings on a target's devices). ``pack_outbox=False``: one copy per leaf, as with the
    GPU copy schedule hint (``CheckpointManager.jit_compiler_options``). ``rehearse=False``:
    without the host replay of every phase on zeros of the state's shapes that ``prepare``
    runs (it checks the host side, not the device programs, and allocates the state's size
    here). ``door_args``: ``model=``/``graphdef=`` for NNX."""
    door = door_for(state, **door_args)
    parts = door.parts(state)
    memory = backend.outbox_memory(door.outbox_memory)
    if not rehearse:
        return make_plan(parts.tx, parts.params, parts.opt_state, parts.extras, k, outbox_memory=memory,
                         pack_outbox=pack_outbox)
    engine = OverlapEngine(parts.tx, MemorySink(), interval=k + 1, window=k,
                           outbox_memory=memory, pack_outbox=pack_outbox)
    try:
        return engine.plan_for(parts.params, parts.opt_state, parts.extras)
    finally:
        engine.close()


def lower_in_window(step: Any, *args: Any, **kwargs: Any) -> LowerStep:
    """``lower(ticket)`` for :func:`overlap_ckpt.aot.compile_window`: ``step`` (a
    ``jax.jit``-wrapped function) lowered on ``args`` and ``kwargs`` with ``ticket`` in the
    window context."""
    def lower(ticket: WindowTicket | None) -> jax.stages.Lowered:
        with window_ticket(ticket):
            return step.lower(*args, **kwargs)
    return lower
