"""Graceful shutdown on SIGTERM (preemption notices, ``kill``, Kubernetes/SLURM stops).

Policy (simple and honest): on SIGTERM the training loop is *not* stepped any further.
Work already handed over is finished if it completes within ``deadline_s``: windows whose
last phase was submitted are replayed and saved, queued and in-flight persists are
committed. A window that is still open (some of its phases never ran) is discarded: its
checkpoint would need training steps that will not happen. Then the process exits with
``exit_code`` after printing one line to stderr::

    overlap_ckpt: SIGTERM: last committed step 16 (drained in 0.21s; open window of step 20 discarded)

With a local tier (``CheckpointManager(local=LocalTier(...))``), the newest local step is
then copied to the durable tier when it is newer than every durable step, within the same
deadline: the replacement job on other hosts resumes from it rather than from the last
``save_interval_steps`` checkpoint. With N processes the copy is collective (each process
writes its own blocks; :meth:`overlap_ckpt.tiers.TieredStore.promote_newest`), so every
process must get the signal at the same step of the loop (docs/tiers.md). The report says so::

    overlap_ckpt: SIGTERM: last committed step 30 (drained in 0.35s; local step 30 copied to the durable tier)

If the deadline passes first, the process exits anyway; whatever persist was in flight
stays an uncommitted ``*.orbax-checkpoint-tmp`` directory, which readers ignore and the
next run removes (crash consistency covers it). The report then says ``deadline passed``.

Usage::

    mngr = CheckpointManager(...)
    overlap_ckpt.preemption.install(mngr, deadline_s=25)   # before the training loop

The handler runs on the main thread, between two bytecodes of the training loop, and
waits there (so no further step runs). The drain itself runs in a helper thread, so even
a drain blocked on a lock the interrupted main thread holds cannot outlive the deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PreemptionReport:
    """What the SIGTERM handler did (passed to ``on_exit`` and printed to stderr)."""

    signal: int
    last_committed_step: int | None
    drained: bool  # every submitted window and queued persist finished within the deadline
    seconds: float
    discarded_window: int | None  # version of the open window that was dropped, if any
    error: str | None = None  # an error raised while draining (e.g. a failed persist)
    promoted: int | None = None  # the local-tier step copied to the durable tier, if any

    def __str__(self) -> str:
        what = f"drained in {self.seconds:.2f}s" if self.drained else \
            f"deadline passed after {self.seconds:.2f}s, in-flight work abandoned"
        if self.discarded_window is not None:
            what += f"; open window of step {self.discarded_window} discarded"
        if self.promoted is not None:
            what += f"; local step {self.promoted} copied to the durable tier"
        if self.error:
            what += f"; error while draining: {self.error}"
        return (f"overlap_ckpt: {signal.Signals(self.signal).name}: last committed step "
                f"{self.last_committed_step} ({what})")


def drain(manager: Any, deadline_s: float) -> tuple[bool, str | None, int | None]:
    """Wait up to ``deadline_s`` for submitted windows and queued persists, then copy the
    newest local-tier step to the durable tier (the store's ``promote_newest``: nothing
    without a local tier) and wait for that too; (done, error, promoted step)."""
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            manager.wait_until_finished()
            outcome["promoted"] = manager.store.promote_newest()  # collective with a local tier
            manager.wait_until_finished()  # on every process, whatever this one promoted
        except BaseException as e:  # noqa: BLE001 - reported, never raised in the handler
            outcome["error"] = f"{type(e).__name__}: {e}"

    helper = threading.Thread(target=work, name="overlap-ckpt-preemption-drain", daemon=True)
    helper.start()
    helper.join(max(0.0, deadline_s))
    done = not helper.is_alive()
    return done, outcome.get("error"), outcome.get("promoted") if done and "error" not in outcome else None


def install(manager: Any, deadline_s: float = 30.0, *, signals: tuple[int, ...] = (signal.SIGTERM,),
            exit_code: int = 143, on_exit: Callable[[PreemptionReport], None] | None = None,
            exit: Callable[[int], None] | None = None) -> Callable[[], None]:
    """Register the graceful-shutdown handler for ``manager`` (a :class:`CheckpointManager`).

    Must be called from the main thread. ``on_exit(report)`` is called before the process
    exits (keep it short: it counts against nothing but runs after the deadline check).
    ``exit`` defaults to ``os._exit`` after flushing stdout/stderr: ``sys.exit`` would run
    ``with``-blocks and ``finally`` clauses that may wait on storage without a deadline.
    Returns a function that restores the previous handlers.
    """
    if deadline_s < 0:
        raise ValueError(f"deadline_s must be >= 0, got {deadline_s!r}")
    fired = threading.Event()

    def handler(signum, frame) -> None:  # noqa: ARG001
        if fired.is_set():
            return  # a second SIGTERM while draining: the deadline still applies
        fired.set()
        start = time.monotonic()
        window = manager.open_window()
        log.warning("received %s: finishing submitted checkpoint work (deadline %.1fs)",
                    signal.Signals(signum).name, deadline_s)
        done, error, promoted = drain(manager, deadline_s)
        store = manager.store
        try:
            last = store.latest_step()
        except Exception as e:  # noqa: BLE001
            last, error = None, error or f"{type(e).__name__}: {e}"
        report = PreemptionReport(signum, last, done, time.monotonic() - start, window, error, promoted)
        if done:
            try:
                store.release_lock()  # the next job may start at once (the kernel would anyway)
            except Exception:  # noqa: BLE001
                pass
        if on_exit is not None:
            try:
                on_exit(report)
            except Exception:  # noqa: BLE001
                log.exception("preemption on_exit callback failed")
        print(str(report), file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        (exit or os._exit)(exit_code)

    previous = {s: signal.signal(s, handler) for s in signals}

    def uninstall() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    return uninstall


__all__ = ["install", "drain", "PreemptionReport"]
