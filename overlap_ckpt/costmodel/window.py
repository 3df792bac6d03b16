"""The one rule that chooses the window size K, and K predicted from a step's program.

Why here: K used to be chosen in four places (the manager's auto-K, the prediction from a
lowered step, and twice in ``overlap-ckpt aot``), each building the cost model's profile
its own way. They now all call :func:`choose_window`, so a report's "auto" column is what
a run's ``window="auto"`` picks for the same figures.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .hardware import Hardware
from .model import TrainingProfile, choose_k, predicted_step_time_s

log = logging.getLogger(__name__)

MFU = 0.5  # assumed model-FLOPs utilisation of a predicted step (as overlap-ckpt aot assumes)


@dataclasses.dataclass(frozen=True)
class CompiledSchedule:
    """What the window rule reads from where a compiled window step schedules its host
    copies (:func:`overlap_ckpt.aot.predict.compiled_schedule`).

    ``hide_fraction``: the share of the step one copy transfers under, at best (None: no
    matmuls or no host copy to tell by); ``overlapped_bytes``: the bytes of its copies the
    schedule overlapped, where it serialized more than a small copy's worth (None: it
    serialized nothing that counts). Both bound the bytes a step hides: the first by time,
    the second by what the compiler would overlap at all."""

    hide_fraction: float | None = None
    overlapped_bytes: float | None = None

    def least(self, other: CompiledSchedule) -> CompiledSchedule:
        """The tighter of two phases' readings, each field on its own (a window hides no
        more than its worst phase allows)."""
        def lesser(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else min(a, b)
        return CompiledSchedule(lesser(self.hide_fraction, other.hide_fraction),
                                lesser(self.overlapped_bytes, other.overlapped_bytes))


def choose_window(step_time_s: float, d2h_bytes_per_s: float, state_bytes: float, grad_bytes: float,
                  persist_bytes_per_s: float, interval_steps: int | None,
                  overlappable_fraction: float = TrainingProfile.overlappable_fraction,
                  schedule_capacity_bytes: float | None = None) -> int:
    """K for a step of ``step_time_s`` seconds: the one rule behind ``window="auto"`` and
    ``overlap-ckpt aot``, whether the step time was measured on the device
    (:class:`overlap_ckpt.manager.window_choice.AutoWindow`) or predicted, from the step's
    flops (:func:`predict_window`) or from the program compiled for a target
    (:mod:`overlap_ckpt.aot.predict`, which passes the fraction of the step its compiled
    copies hide under, and the bytes they overlapped where it serialized the rest:
    ``schedule_capacity_bytes``). ``interval_steps``: the steps between checkpoints (K
    maximises the goodput at that interval); None for the least stall of one checkpoint alone."""
    profile = TrainingProfile(step_time_s=step_time_s, d2h_bytes_per_s=d2h_bytes_per_s,
                              state_bytes=state_bytes, grad_bytes=grad_bytes,
                              persist_bytes_per_s=persist_bytes_per_s,
                              overlappable_fraction=overlappable_fraction,
                              schedule_capacity_bytes=schedule_capacity_bytes)
    return choose_k(profile, interval_steps=interval_steps)


@dataclasses.dataclass(frozen=True)
class PredictedWindow:
    """K chosen before the first window, and what it was chosen from (logged, inspectable)."""

    k: int
    step_time_s: float
    flops_per_device: float
    host_link_bytes_per_s: float
    hardware: str


def predict_window(lowered: Any, hardware: Hardware | None, devices: int, state_bytes: float,
                   grad_bytes: float, persist_bytes_per_s: float, interval_steps: int) -> PredictedWindow | None:
    """K for the plain step ``lowered`` (a ``jax.stages.Lowered``) on ``hardware`` (the
    figures of the device it runs on, :func:`overlap_ckpt.costmodel.hardware.hardware_of`).

    ``state_bytes`` and ``grad_bytes`` are per device (each device copies its own shards
    over its own link). The flops come from XLA's cost analysis of the lowered program,
    before partitioning, so they are divided over the ``devices`` the step runs on; its
    byte count is not used, because before fusion it counts every intermediate (3x the
    optimized program's on a small LM). None when the device's numbers are unknown or the
    backend gives no cost analysis: the manager then measures
    (:class:`overlap_ckpt.manager.window_choice.AutoWindow`).
    """
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
    step_time_s = predicted_step_time_s(flops, hardware.peak_flops, MFU)
    k = choose_window(step_time_s, hardware.host_link_bytes_per_s, state_bytes, grad_bytes,
                      persist_bytes_per_s, interval_steps)
    log.info("window='auto': predicted step %.4fs on %s, K=%d", step_time_s, hardware.sources, k)
    return PredictedWindow(k, step_time_s, flops, hardware.host_link_bytes_per_s, hardware.sources)
