"""``window="auto"``: choose K from the step's cost and the device-to-host bandwidth.

On the CPU backend the "device" is host memory and nothing overlaps, so K is 1. On an
accelerator K comes from the cost model (:func:`overlap_ckpt.costmodel.choose_k`) with one
of two step times:

* **predicted**, when the step is given to ``compile_ahead`` and the device is one whose
  numbers :mod:`overlap_ckpt.aot.targets` knows (H100, TPU v4/v5e/v5p/v6e): the step's own
  program, lowered once, gives its flops (XLA's cost analysis), and the step time is the
  one ``overlap-ckpt aot`` predicts for that target (:func:`predict_window`). K is known
  before the first window, which already runs with it;
* **measured** (:class:`AutoWindow`), in every run on an accelerator: the manager times a
  few steps outside windows (two host syncs in the whole run), measures the
  device-to-host bandwidth once, and the next window uses the K it gives (K=1 until then
  when nothing was predicted). A prediction rests on a datasheet and an assumed MFU; the
  measurement corrects it.

The machine-dependent inputs (the clock, the bandwidth probe, the device's numbers) are
module attributes that tests replace (:func:`overlap_ckpt.testing.emulate_accelerator`) to
run both paths on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax

from . import costmodel
from .core import backend
from .errors import ConfigError

log = logging.getLogger(__name__)

MEASURE_STEPS = 5  # steps timed before choosing K

MFU = 0.5  # assumed model-FLOPs utilisation of a predicted step (as overlap-ckpt aot assumes)


def _known_hardware(device: Any) -> Any:
    from .aot.targets import hardware_of

    return hardware_of(device)


# Replaced by overlap_ckpt.testing to exercise the accelerator paths on the CPU backend.
measure_bandwidth: Callable[[Any], float] = costmodel.measure_d2h_bandwidth
clock: Callable[[], float] = time.perf_counter
hardware_of: Callable[[Any], Any] = _known_hardware  # -> aot.targets.Hardware | None


class AutoWindow:
    """Times ``MEASURE_STEPS`` steps after :meth:`start`, then proposes K once."""

    def __init__(self, interval_steps: int, persist_bytes_per_s: float):
        self.interval_steps = interval_steps
        self.persist_bytes_per_s = persist_bytes_per_s
        self._start: tuple[float, int] | None = None
        self.done = False
        self.step_time_s: float | None = None

    def wants_measurement(self, leaf: Any) -> bool:
        """False where K=1 is final: on the CPU backend, and where JAX's CPU backend, which
        replays windows of K > 1, is not initialized (``JAX_PLATFORMS=cuda``)."""
        device = next(iter(leaf.sharding.device_set))
        if backend.platform_of(device) == "cpu":
            self.done = True
        elif not self.done:
            try:
                backend.replay_device()
            except ConfigError as e:
                log.warning("window='auto' keeps K=1: %s", e)
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
                  persist_bytes_per_s: float, interval_steps: int,
                  overlappable_fraction: float = costmodel.TrainingProfile.overlappable_fraction) -> int:
    """K for a step of ``step_time_s`` seconds: the one rule behind ``window="auto"``,
    whether the step time was measured on the device (:class:`AutoWindow`) or predicted
    from the compiled program for a target (:mod:`overlap_ckpt.aot.predict`, which passes
    the fraction of the step its compiled copies hide under)."""
    profile = costmodel.TrainingProfile(step_time_s=step_time_s, d2h_bytes_per_s=d2h_bytes_per_s,
                                        state_bytes=state_bytes, grad_bytes=grad_bytes,
                                        persist_bytes_per_s=persist_bytes_per_s,
                                        overlappable_fraction=overlappable_fraction)
    return costmodel.choose_k(profile, interval_steps=interval_steps)


@dataclasses.dataclass(frozen=True)
class PredictedWindow:
    """K chosen before the first window, and what it was chosen from (logged, inspectable)."""

    k: int
    step_time_s: float
    flops_per_device: float
    host_link_bytes_per_s: float
    hardware: str


def predict_window(lowered: Any, device: Any, devices: int, state_bytes: float, grad_bytes: float,
                   persist_bytes_per_s: float, interval_steps: int) -> PredictedWindow | None:
    """K for the plain step ``lowered`` (a ``jax.stages.Lowered``) on ``device``'s hardware.

    ``state_bytes`` and ``grad_bytes`` are per device (each device copies its own shards
    over its own link). The flops come from XLA's cost analysis of the lowered program,
    before partitioning, so they are divided over the ``devices`` the step runs on; its
    byte count is not used, because before fusion it counts every intermediate (3x the
    optimized program's on a small LM). None when the device's numbers are unknown or the
    backend gives no cost analysis: the manager then measures (:class:`AutoWindow`).
    """
    hardware = hardware_of(device)
    if hardware is None:
        return None
    try:
        analysis = lowered.cost_analysis()
    except Exception as e:  # noqa: BLE001 - a backend without cost analysis: measure instead
        log.info("window='auto': no cost analysis of the step (%s); measuring instead", e)
        return None
    flops = (analysis or {}).get("flops")
    if not flops or flops <= 0:
        return None
    flops /= max(devices, 1)
    step_time_s = costmodel.predicted_step_time_s(flops, hardware.peak_flops, MFU)
    k = choose_window(step_time_s, hardware.host_link_bytes_per_s, state_bytes, grad_bytes,
                      persist_bytes_per_s, interval_steps)
    log.info("window='auto': predicted step %.4fs on %s, K=%d", step_time_s, hardware.sources, k)
    return PredictedWindow(k, step_time_s, flops, hardware.host_link_bytes_per_s, hardware.sources)
