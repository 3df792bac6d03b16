"""Window variants compiled on the training thread: counted, and the user told once.

Why: a window step is a variant of the user's step (one per window phase), compiled the
first time it runs. ``CheckpointManager.compile_ahead`` compiles the variants on a
background thread; without it, the first window's steps compile them on the training
thread, one compile of the whole step each. In a loop that never syncs this was the whole
of the gap to Orbax async at a checkpoint every 50 steps (issue 58: one compile of the 20M
LM's variant, 2-3 s on 2 cores, inside a 100-step span of ~26 s;
benchmarks/results/cpu_20m_first_window.md), and on an accelerator a large model's compile
takes minutes while the device idles. The cost is paid once per run (the variants are
cached), so nothing fails; but a user who never reads the docs would not know where those
seconds went, nor that one call removes them.

What is counted: XLA backend compiles (jax's monitoring event) on a thread that holds a
manager's window ticket (handed out by ``mngr.step``: the training thread; the compile-ahead
thread holds none), per manager. Besides the step's variants this includes any other jitted
function the loop first calls during a window (its key holds the ticket too,
:mod:`overlap_ckpt.core.window_context`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import jax

from ..core.window_context import handed_out

log = logging.getLogger(__name__)

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_seconds: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()  # {manager: seconds}
_listening = False


def watch() -> None:
    """Count compiles from now on (one listener per process, for every manager)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True


def _on_duration(event: str, duration_secs: float, **_: Any) -> None:
    if event != COMPILE_EVENT:
        return
    owners = handed_out()
    if not owners:
        return
    with _lock:
        for owner in owners:
            _seconds[owner] = _seconds.get(owner, 0.0) + duration_secs


def seconds(owner: Any) -> float:
    """Seconds of compiles on ``owner``'s training thread while its window tickets were out."""
    with _lock:
        return _seconds.get(owner, 0.0)


class CompileReport:
    """Tells the user once, after a window, what its variants cost the training thread."""

    def __init__(self, owner: Any):
        self._owner = weakref.ref(owner)
        self._told = 0.0
        watch()

    def after_window(self, compiled_ahead: bool) -> float:
        """After a window's last step: the training thread's compile seconds new since the
        last report, logged as a warning with the fix when there are any."""
        owner = self._owner()
        total = seconds(owner) if owner is not None else 0.0
        new, self._told = total - self._told, total
        if new <= 0:
            return 0.0
        if compiled_ahead:
            log.warning(
                "a checkpoint window compiled %.2f s on the training thread although compile_ahead was "
                "called: the window step's arguments differ from those given to compile_ahead (another "
                "shape, dtype or sharding; give it the arguments of a real call), another jitted function "
                "first ran in the window, or the window ran without copies (a skipped window's variants "
                "compile ahead only with on_host_budget='skip').", new)
        else:
            log.warning(
                "the checkpoint window compiled its step variants on the training thread (%.2f s, once "
                "per run): call mngr.compile_ahead(train_step, *args) after mngr.prepare(...) to compile "
                "them in the background (docs/porting.md)", new)
        return new
