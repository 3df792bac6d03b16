"""The prediction set beside a measurement, on the one backend where both exist.

``overlap-ckpt aot --target cpu --measure``: the CPU target's step time is predicted
exactly as an accelerator's (compiled cost analysis against the machine's peak rate, here
a measured matmul rate, at the same MFU), then the same compiled step runs on zeros of the
state's shapes; Orbax async's stall (state bytes over the memcpy bandwidth) is set beside
a timed blocking copy of the state. The ratio says how far to trust the model's inputs;
the window's own stall on the CPU is not comparable (host memory is device memory, nothing
is copied asynchronously), so it is not predicted here.
"""

from __future__ import annotations

import dataclasses

from ...aot import predict
from ...aot.window import WindowReport
from .calibrate import measure_blocking_copy_s, measure_step_s, zeros_of
from .lm_step import LMSetup, lower_reference


@dataclasses.dataclass(frozen=True)
class Calibration:
    predicted_step_s: float
    measured_step_s: float
    predicted_orbax_stall_s: float
    measured_orbax_stall_s: float

    def markdown(self) -> str:
        return "\n".join([
            "## Prediction against measurement (CPU)", "",
            "| quantity | predicted s | measured s | measured / predicted |", "|---|---|---|---|",
            f"| plain step | {self.predicted_step_s:.4g} | {self.measured_step_s:.4g} | "
            f"{self.measured_step_s / self.predicted_step_s:.2f} |",
            f"| Orbax async stall (blocking copy of the state) | {self.predicted_orbax_stall_s:.4g} | "
            f"{self.measured_orbax_stall_s:.4g} | {self.measured_orbax_stall_s / self.predicted_orbax_stall_s:.2f} |",
            ""])


def calibrate(setup: LMSetup, report: WindowReport, cost: predict.StepCost) -> Calibration:
    """Run the plain step and a blocking state copy for real on the CPU target."""
    if report.target.platform != "cpu":
        raise ValueError("measuring needs the device: only the cpu target can be measured here")
    args = (setup.params, setup.opt_state, setup.batch, setup.step)
    step_s = measure_step_s(lower_reference(setup), args)
    state = measure_blocking_copy_s(zeros_of((setup.params, setup.opt_state)))
    return Calibration(cost.step_time_s, step_s, predict.orbax_async_stall_s(report), state)

