"""The cost model: what a checkpoint costs, the window size K it chooses, and the hardware
figures it reads.

* :mod:`~overlap_ckpt.costmodel.model` — the pure model: a step's profile in, stalls,
  background time and goodput out (no JAX, cheap to import);
* :mod:`~overlap_ckpt.costmodel.window` — the one rule that chooses K, used by the
  manager's ``window="auto"`` and by ``overlap-ckpt aot``;
* :mod:`~overlap_ckpt.costmodel.hardware` — datasheet figures of known accelerators and
  the probes that measure a machine's own.
"""

from .model import (GB, CheckpointEstimate, Strategy, TrainingProfile, check_int, check_number, choose_k, estimate,
                    min_zero_stall_k, predict_background_s, predict_ettr, predict_stall_s, predicted_step_time_s,
                    replayed_bytes, window_transfer_bytes)

__all__ = ["GB", "CheckpointEstimate", "Strategy", "TrainingProfile", "check_int", "check_number", "choose_k",
           "estimate", "min_zero_stall_k", "predict_background_s", "predict_ettr", "predict_stall_s",
           "predicted_step_time_s", "replayed_bytes", "window_transfer_bytes", "measure_d2h_bandwidth"]


def __getattr__(name: str):
    # The probe imports jax; the model alone does not (tools.simulate, goodput planning).
    if name == "measure_d2h_bandwidth":
        from .hardware import measure_d2h_bandwidth
        return measure_d2h_bandwidth
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
