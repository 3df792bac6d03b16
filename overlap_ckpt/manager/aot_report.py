"""``CheckpointManager.aot_report``: a user's own step, checked for a target in one call, with
what this manager knows (its door, its window, its checkpoint interval, its copy hint).

Why here and not in the manager: the manager stays the per-step API; the report is
:func:`overlap_ckpt.aot.report_step`, given the manager's settings, and the copy schedule
hint (a manager policy, one floor above ``aot``) is made here when asked for.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..aot.step_report import StepReport, UserStep, report_step
from ..aot.targets import Target
from ..doors.base import Door
from .copy_schedule import CopyScheduleHints


def manager_report(door: Door | None, window: int | str, interval: int | None, hinted: bool, step_fn: Any,
                   args: tuple, kwargs: dict, *, target: Target | str, ks: Sequence[int] | None,
                   intervals: Sequence[int] | None, copy_hints: bool | None) -> StepReport:
    """The report of ``step_fn(*args, **kwargs)`` for ``target`` with the K this manager
    would use: ``window`` when it is a number, else what ``window="auto"`` picks at this
    manager's ``interval`` (``ks``: these K instead). ``intervals``: the report's ETTR
    columns (default: the manager's interval). ``copy_hints`` None: on where the manager's
    own compiles use the hint (``hinted``: ``jit_compiler_options`` was called on a GPU)."""
    if door is None:
        raise RuntimeError("aot_report: call prepare() first (the report finds the state among the step's "
                           "arguments as the manager prepared it)")
    use_hints = hinted if copy_hints is None else copy_hints
    user = UserStep(step_fn, tuple(args), dict(kwargs), model=getattr(door, "model", None),
                    graphdef=getattr(door, "graphdef", None))
    return report_step(user, target, ks=ks, window=window, interval=interval,
                       intervals=tuple(intervals) if intervals else ((interval,) if interval else (10, 50)),
                       hints=CopyScheduleHints() if use_hints else None)
