"""``window="auto"``: choose K from the measured step time and device-to-host bandwidth.

On the CPU backend the "device" is host memory and nothing overlaps, so K is 1. On an
accelerator the manager starts with K=1, times a few steps outside windows (two host
syncs in the whole run), measures the device-to-host bandwidth once, and asks the cost
model (:func:`overlap_ckpt.costmodel.choose_k`) for K; the next window uses it. Before a
run, :func:`choose_window` gives the same answer from a step time predicted for a target
from its compiled program (``overlap-ckpt aot``), so K need not start at 1 "until measured".

The two measurements are the only inputs that depend on the machine; tests replace them
(:func:`overlap_ckpt.testing.emulate_accelerator`) to run this path on the CPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import jax

from . import costmodel
from .core import backend

log = logging.getLogger(__name__)

MEASURE_STEPS = 5  # steps timed before choosing K

# Replaced by overlap_ckpt.testing to exercise the accelerator path on the CPU backend.
measure_bandwidth: Callable[[Any], float] = costmodel.measure_d2h_bandwidth
clock: Callable[[], float] = time.perf_counter


class AutoWindow:
    """Times ``MEASURE_STEPS`` steps after :meth:`start`, then proposes K once."""

    def __init__(self, interval_steps: int, persist_bytes_per_s: float):
        self.interval_steps = interval_steps
        self.persist_bytes_per_s = persist_bytes_per_s
        self._start: tuple[float, int] | None = None
        self.done = False
        self.step_time_s: float | None = None

    def wants_measurement(self, leaf: Any) -> bool:
        """False on the CPU backend, where K=1 is final."""
        device = next(iter(leaf.sharding.device_set))
        if backend.platform_of(device) == "cpu":
            self.done = True
        return not self.done

    def restart(self) -> None:
        """Forget a partial measurement (a resume, a re-plan)."""
        self._start = None

    def observe(self, leaf: jax.Array, step: int, state_bytes: int, grad_bytes: int) -> int | None:
        """Call after a step outside a window with one leaf of the new state; returns K when
        the measurement is complete, else None (and None forever after)."""
        if self.done:
            return None
        if self._start is None:
            leaf.block_until_ready()
            self._start = (clock(), step)
            return None
        start, start_step = self._start
        if step - start_step < MEASURE_STEPS:
            return None
        leaf.block_until_ready()
        self.step_time_s = (clock() - start) / (step - start_step)
        self.done = True
        try:
            k = choose_window(self.step_time_s, measure_bandwidth(next(iter(leaf.sharding.device_set))),
                              state_bytes, grad_bytes, self.persist_bytes_per_s, self.interval_steps)
        except Exception as e:  # noqa: BLE001 - auto-tuning must never break training
            log.warning("window='auto' could not choose K (%s); keeping K=1", e)
            return 1
        log.info("window='auto': step %.4fs, K=%d", self.step_time_s, k)
        return k


def choose_window(step_time_s: float, d2h_bytes_per_s: float, state_bytes: float, grad_bytes: float,
                  persist_bytes_per_s: float, interval_steps: int) -> int:
    """K for a step of ``step_time_s`` seconds: the one rule behind ``window="auto"``,
    whether the step time was measured on the device (:class:`AutoWindow`) or predicted
    from the compiled program for a target (:mod:`overlap_ckpt.aot.predict`)."""
    profile = costmodel.TrainingProfile(step_time_s=step_time_s, d2h_bytes_per_s=d2h_bytes_per_s,
                                        state_bytes=state_bytes, grad_bytes=grad_bytes,
                                        persist_bytes_per_s=persist_bytes_per_s)
    return costmodel.choose_k(profile, interval_steps=interval_steps)
