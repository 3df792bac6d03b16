"""Compile-only checks of the accelerator path: window programs compiled for an H100 or a
TPU slice on a machine without either, read from their schedule and memory analysis, and
the stall they predict (``overlap-ckpt aot``, docs/aot.md)."""

from . import predict
from .hlo import DeviceCopy, HostCopy
from .placement import Placement, PlacementError
from .programs import DeviceMemory, ProgramReport, compile_program
from .step_report import CopyFact, PhaseFact, StepError, StepReport, UserStep, report_step
from .targets import Target, TargetError, get_target
from .user_step import lower_in_window, plan_state
from .window import AotCheckError, WindowReport, compile_window

__all__ = ["DeviceCopy", "HostCopy", "DeviceMemory", "ProgramReport", "compile_program", "Target",
           "TargetError", "get_target", "AotCheckError", "WindowReport", "compile_window", "lower_in_window",
           "plan_state", "Placement", "PlacementError", "CopyFact", "PhaseFact", "StepError", "StepReport", "UserStep",
           "report_step"]
