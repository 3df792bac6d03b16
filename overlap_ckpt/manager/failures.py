"""Background failures of one manager: collected from the engine and the store, kept, and
reported at the next call.

Why a unit of its own: a replay or a write fails on a background thread, where raising
reaches nobody. Like Orbax's async saves, the failure is raised from the user's next call
(``on_error="raise"``) or logged (``on_error="log"``), and either way it is kept for
``failed_steps()``: logging alone would let a job train for hours without a checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import CheckpointError, CheckpointFailure

log = logging.getLogger(__name__)

_KEEP_TRACEBACKS = 16  # failures older than this keep their message, not their frames


class FailureLog:
    """Every failed checkpoint of one manager, oldest first."""

    def __init__(self, directory: Any):
        self._directory = directory
        self._failures: list[CheckpointFailure] = []

    def all(self) -> list[CheckpointFailure]:
        return list(self._failures)

    def collect(self, engine: Any, store: Any) -> list[CheckpointFailure]:
        """Take the failures the engine (``None``: none built yet) and the store recorded
        since the last call; returns the new ones."""
        new = engine.take_failures() if engine is not None else []
        new += [CheckpointFailure(getattr(e, "step", None), "persist", e) for e in store.take_errors()]
        if new:
            self._failures += new
            for old in self._failures[:-_KEEP_TRACEBACKS]:
                _drop_traceback(old.error)  # frames of a failed persist hold its host copy alive
        return new

    def report(self, new: list[CheckpointFailure], *, raise_them: bool) -> None:
        """Raise ``new`` as one :class:`CheckpointError` (``raise_them``), else log each."""
        if not new:
            return
        if not raise_them:
            for failure in new:
                log.error("checkpoint %s", failure)
            return
        lines = "; ".join(str(f) for f in new[:5]) + (f"; and {len(new) - 5} more" if len(new) > 5 else "")
        error = CheckpointError(
            f"{len(new)} checkpoint(s) failed in the background: {lines}. Training can go on; "
            "mngr.failed_steps() lists every failure. Fix the cause (e.g. free disk space) for the "
            "next checkpoints, or pass on_error='log' to keep training without this exception.",
            step=new[0].step, path=str(self._directory), failures=tuple(new))
        raise error from new[0].error


def _drop_traceback(error: BaseException | None) -> None:
    while error is not None and error.__traceback__ is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
