"""The host memory overlapped checkpointing may hold, and what a window does when it is full.

Why a budget at all: async checkpointers that copy whenever asked hold several host copies
of the state when storage is slower than the interval, and the host runs out of memory
(Orbax issues #1640, #2090). Here one number, ``max_host_bytes``, bounds *everything* a
checkpoint holds on the host: the host copy itself, the replay's scratch, the writer's
staging, and the copies of earlier checkpoints still in flight (outboxes not yet replayed,
copies not yet persisted).

Why it is checked at the start of a window: that is the last moment a checkpoint can be
declined or delayed before its first slice is copied. When the copies in flight plus what
one checkpoint needs would exceed the budget, the window either

* ``"wait"`` (default): blocks the training thread until the earlier checkpoints are
  persisted, as Orbax's ``save`` waits for the previous save; no checkpoint is lost, the
  window starts late. Measured with a checkpoint every 2 steps, persists slower than that
  (benchmarks/results/cpu_small_*_soak.json): "wait" committed 100 of 100 checkpoints at
  ETTR 0.93, "skip" 50 at ETTR 0.80 (Orbax async 0.72 in both runs);
* ``"skip"``: runs the window's steps without copies; the checkpoint is not taken.

Either way each delayed or skipped checkpoint is logged once, with the reason, and
counted in :meth:`HostBudget.summary`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Collection

from ..errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_FACTOR = 1.25  # x the state's bytes: one host copy at a time, plus its scratch
MIN_HEADROOM = 16 << 20  # small states: room for a second copy, which costs nothing worth waiting for
POLICIES = ("wait", "skip")


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What one checkpoint needs on this host, in bytes.

    ``copy``: the host copy of this process's blocks; ``scratch``: the most the replay
    and the writer hold besides the copy at any moment. For a window of K>1 steps that is
    one phase's outbox (its captured slice until it is copied in, the gradient pieces of
    the slices it advances until they are applied) and one replay call; the replay frees
    each part as soon as it is used (tests/core/test_replay_memory.py counts them)."""

    copy: int
    scratch: int

    @property
    def total(self) -> int:
        return self.copy + self.scratch


@dataclasses.dataclass
class BudgetSummary:
    """Checkpoints the budget let through, delayed or skipped (see :meth:`HostBudget.summary`)."""

    limit_bytes: int
    admitted: int = 0
    delayed: int = 0
    delay_seconds: float = 0.0
    skipped_steps: list[int] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        text = (f"host budget {self.limit_bytes / 2**20:.0f} MiB: {self.admitted} checkpoint(s) started, "
                f"{self.delayed} delayed ({self.delay_seconds:.2f} s waiting in total), "
                f"{len(self.skipped_steps)} skipped")
        return text + (f" (steps {self.skipped_steps})" if self.skipped_steps else "")


def _size(nbytes: int) -> str:
    """Bytes for a log line, in the unit that keeps them apart: in MiB alone, a small state's
    copies in flight read "0.0 MiB", and the reason for a delay did not add up."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


class HostBudget:
    """Admits a checkpoint window when its host memory fits ``max_host_bytes``.

    Args:
      max_host_bytes: the bound (default ``1.25x`` the state, or the footprint of one
        checkpoint when that is more). A bound below one checkpoint's footprint is refused
        by :meth:`bind` with the minimum in the message: it would skip every checkpoint.
      on_full: ``"wait"`` or ``"skip"`` (see the module docstring).
    """

    def __init__(self, max_host_bytes: int | None = None, on_full: str = "wait"):
        if max_host_bytes is not None and (isinstance(max_host_bytes, bool) or not isinstance(
                max_host_bytes, int) or max_host_bytes < 1):
            raise ConfigError(f"max_host_bytes must be a positive int, got {max_host_bytes!r}")
        if on_full not in POLICIES:
            raise ConfigError(f"on_host_budget must be one of {POLICIES}, got {on_full!r}")
        self.max_host_bytes = max_host_bytes
        self.on_full = on_full
        self.footprint: Footprint | None = None
        self.limit = 0
        self._summary = BudgetSummary(0)

    def bind(self, footprint: Footprint) -> int:
        """Set the bound for checkpoints of ``footprint``; returns it."""
        if self.max_host_bytes is not None and self.max_host_bytes < footprint.total:
            raise ConfigError(
                f"max_host_bytes={self.max_host_bytes} is smaller than one checkpoint needs on this "
                f"host: at least {footprint.total} bytes ({footprint.copy} for the host copy of the "
                f"state + {footprint.scratch} for replay and writer buffers). Every checkpoint would "
                f"be skipped; pass max_host_bytes >= {footprint.total}.")
        self.footprint = footprint
        self.limit = self.max_host_bytes or max(int(DEFAULT_FACTOR * footprint.copy),
                                                footprint.total + min(footprint.copy, MIN_HEADROOM))
        self._summary.limit_bytes = self.limit
        return self.limit

    def admit(self, version: int, held: Callable[[], int], wait: Callable[[], None]) -> bool:
        """May the window of ``version`` start? ``held()`` is what earlier checkpoints hold
        now; ``wait()`` blocks until they are persisted. False: the window is skipped."""
        if self.footprint is None:
            raise RuntimeError("HostBudget.admit before bind()")
        need = self.footprint.total
        before = held()
        if before + need <= self.limit:
            self._summary.admitted += 1
            return True
        reason = (f"earlier checkpoints still hold {_size(before)} of host memory and this one needs "
                  f"{_size(need)}, {_size(before + need - self.limit)} more than max_host_bytes="
                  f"{self.limit} ({_size(self.limit)}) allows")
        if self.on_full == "skip":
            log.warning("checkpoint of step %d skipped: %s. A checkpoint interval shorter than the write "
                        "time keeps skipping; on_host_budget='wait' delays instead.", version, reason)
            self._summary.skipped_steps.append(version)
            del self._summary.skipped_steps[:-1000]
            return False
        start = time.perf_counter()
        wait()
        waited = time.perf_counter() - start
        log.warning("checkpoint of step %d delayed %.2f s until earlier ones were persisted: %s.",
                    version, waited, reason)
        self._summary.admitted += 1
        self._summary.delayed += 1
        self._summary.delay_seconds += waited
        return True

    def summary(self, dropped: Collection[int] = ()) -> BudgetSummary:
        """A copy of the counts so far (``print(mngr.summary())``); ``dropped``: steps the
        store dropped (its back-pressure), which count as skipped."""
        skipped = sorted(set(self._summary.skipped_steps) | set(dropped))
        return dataclasses.replace(self._summary, skipped_steps=skipped)


def admit_window(budget: HostBudget, engine: Any, store: Any, step: int) -> None:
    """Admit the window that starts at ``step`` under ``budget``: wait for earlier
    checkpoints (the engine's replays, the store's writes) or mark it skipped."""
    budget.bind(Footprint(*engine.footprint()))  # the plan may have changed

    def held() -> int:
        return store.held_bytes() + engine.held_bytes()

    def wait() -> None:
        engine.flush()
        store.flush()
        engine.release_idle_buffers()
        engine.flush()

    version = engine.schedule.version(step, 0)
    if not budget.admit(version, held, wait):
        engine.windows.skip(version)
