"""Which training step belongs to which checkpoint window, at which phase, and whether this
run captures it.

Checkpoints target versions V that are multiples of ``interval`` (V > 0). The window of V
covers the K steps whose *input* states are S_{V-K+1} .. S_V; step t is in phase
``t - (V - K + 1)``. Windows are aligned on absolute step numbers so that a resumed run
takes its windows at the same steps as an uninterrupted one.

This module is the one owner of K and of the window arithmetic: :class:`WindowSchedule`
validates and clamps K, and :class:`WindowTracker` decides whether a window is captured.
"""

from __future__ import annotations

import dataclasses
import logging

from ..errors import ConfigError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WindowSchedule:
    interval: int
    k: int

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ConfigError(f"save interval must be >= 1 step, got {self.interval}")
        if self.k < 1:
            raise ConfigError(f"window must be >= 1 step, got {self.k}")
        if self.k > self.interval:
            raise ConfigError(
                f"a window of {self.k} steps does not fit a save interval of {self.interval} "
                f"steps (windows would overlap); use window <= {self.interval} or a longer interval.")

    @classmethod
    def clamped(cls, interval: int, k: int) -> "WindowSchedule":
        """Like the constructor, but shrink K to the interval with a warning."""
        if k > interval >= 1:
            log.warning("window of %d steps clamped to the save interval of %d steps", k, interval)
            k = interval
        return cls(interval, k)

    def target(self, step: int) -> int | None:
        """The version V whose window contains ``step``, or None."""
        v = -(-step // self.interval) * self.interval
        if v <= 0 or v - step >= self.k:
            return None
        return v

    def phase(self, step: int) -> int | None:
        v = self.target(step)
        return None if v is None else step - self.first_step(v)

    def first_step(self, version: int) -> int:
        """The step that runs phase 0 of the window of ``version``."""
        return version - self.k + 1

    def version(self, step: int, phase: int) -> int:
        """The version targeted by the window in which ``step`` runs ``phase``."""
        return step - phase + self.k - 1


class WindowTracker:
    """Per-run bookkeeping: which windows this run hands to the host.

    Every step of a scheduled window runs the window variant of the train step, whether
    or not its window is captured: the update of a window step is isolated from the
    backward pass (see :func:`overlap_ckpt.core.capture.isolated`), which can change its
    last bits, so a run's trajectory must depend on the schedule alone for a resumed run to
    reproduce an uninterrupted one bit for bit. A window is *captured* only if this run saw
    its first phase (not after a resume mid-window) and its version is not saved otherwise
    (a synchronous ``save``, a step on storage); a window *skipped* for lack of host memory
    runs its steps without copying anything.
    """

    def __init__(self, schedule: WindowSchedule, start_step: int = 0):
        self.schedule = schedule
        self.start_step = start_step
        self._excluded: set[int] = set()
        self._skipped: set[int] = set()

    def restart(self, start_step: int) -> None:
        """A new run (prepare, restore): windows are captured from ``start_step`` on."""
        self.start_step = start_step

    def exclude(self, version: int) -> None:
        """Never capture the window of ``version`` (it is saved otherwise)."""
        self._excluded = _recent(self._excluded | {version}, self.schedule.interval)

    def skip(self, version: int) -> None:
        """Run the window of ``version`` without copying anything (no host memory for it)."""
        self.exclude(version)
        self._skipped = _recent(self._skipped | {version}, self.schedule.interval)

    def is_excluded(self, version: int) -> bool:
        return version in self._excluded

    def is_skipped(self, version: int) -> bool:
        return version in self._skipped

    def phase(self, step: int) -> int | None:
        """The window phase of ``step`` (None outside windows), captured or not."""
        return self.schedule.phase(step)

    def captures(self, step: int, phase: int) -> bool:
        """Whether the outbox of ``step`` (in ``phase``) goes to the host."""
        version = self.schedule.version(step, phase)
        return version not in self._excluded and self.schedule.first_step(version) >= self.start_step

    def open_window(self, next_step: int) -> int | None:
        """The version of a captured window that ``next_step`` would continue (phase > 0)."""
        phase = self.phase(next_step)
        if phase in (None, 0) or not self.captures(next_step, phase):
            return None
        return self.schedule.version(next_step, phase)


def _recent(versions: set[int], interval: int) -> set[int]:
    """Versions far behind the newest can never come back: keep the set small on long runs."""
    horizon = max(versions) - 2 * interval
    return {v for v in versions if v >= horizon}
