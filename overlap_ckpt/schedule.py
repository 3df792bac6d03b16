"""Which training step belongs to which checkpoint window, and at which phase.

Checkpoints target versions V that are multiples of ``interval`` (V > 0). The window of V
covers the K steps whose *input* states are S_{V-K+1} .. S_V; step t is in phase
``t - (V - K + 1)``. Windows are aligned on absolute step numbers so that a resumed run
takes its windows at the same steps as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import logging

from .errors import ConfigError

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
        return None if v is None else step - (v - self.k + 1)
