"""Fault-injection hook: a callable invoked at named stages of every persist.

Why: crash-consistency can only be trusted if a test kills the writer at each stage and
checks what survives. Production code calls :func:`fire` at fixed points; tests install a
hook (which may ``os.kill(os.getpid(), SIGKILL)``, raise ``OSError(ENOSPC)``, sleep...).
With no hook installed :func:`fire` is a dictionary lookup and nothing else.

Stages, in order, for one step (``info`` always has ``step``):

``start``             the worker picked the step up (nothing written yet)
``array_write``       before the writes of one array are issued (``info['array']``)
``data_written``      every array byte of this process is written and fsync'd
``metadata_written``  merged OCDBT root and tree/step metadata written (step still uncommitted)
``before_commit``     right before the commit (dir fsyncs + marker + rename / marker)
``committed``         the step is visible to ``latest_step``
``retention``         old steps were deleted (``info['deleted']``)
"""

from __future__ import annotations

from typing import Any, Callable

FaultHook = Callable[[str, dict[str, Any]], None]

STAGES = ("start", "array_write", "data_written", "metadata_written", "before_commit",
          "committed", "retention")

_hook: FaultHook | None = None


def set_fault_hook(hook: FaultHook | None) -> FaultHook | None:
    """Install ``hook`` (``None`` removes it); returns the previous one so tests can restore it."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def fire(stage: str, **info: Any) -> None:
    """Call the installed hook, if any. Exceptions from the hook propagate like real faults."""
    hook = _hook
    if hook is not None:
        hook(stage, info)
