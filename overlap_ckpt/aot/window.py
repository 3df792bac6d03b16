"""Compile a train step's plain program and every window phase for a target, and check them.

Why: the claims the library makes about the accelerator path (the window copies are
asynchronous, overlap the step's compute, cost no device memory beyond the outbox, and
outside windows the step is the user's own program) are properties of the compiled
programs, so they are checked on the compiled programs, for the target, without it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import jax

from ..core.packing import SMALL_COPY_BYTES
from ..core.plan import CapturePlan
from ..core.ticket import WindowTicket
from .programs import ProgramReport, compile_program
from .targets import Target

# A blocking copy above this is a stall worth failing on (the small copies a TPU phase still
# makes on its own are packed or, at most this size, tolerated: overlap_ckpt.core.packing).
MAX_SERIALIZED_BYTES = SMALL_COPY_BYTES

# Device memory a window phase may need beyond the plain step's and its outbox's. Why any:
# XLA lays temporaries out around a buffer that lives the whole step (a packed outbox on
# GPU: the tiny Linen LM's last phase holds plain + outbox + 12 live bytes at its peak, and
# its buffer assignment spans 54 KB more), and XLA:TPU reserves 16 KiB of device memory per
# asynchronous operation (the tiny Linen LM's phase 0: 298 KiB beyond). Why this much: it
# is fixed, so it cannot hide anything that grows with the state, and a copy of a leaf is
# checked on its own (MAX_DEVICE_COPY_BYTES), however large the outbox allowance.
LAYOUT_ALLOWANCE_BYTES = SMALL_COPY_BYTES
# A copy of a step argument within device memory (a donated leaf kept alive past the output
# that reuses its buffer) above this many bytes fails the check even within the allowance.
MAX_DEVICE_COPY_BYTES = SMALL_COPY_BYTES

LowerStep = Callable[[WindowTicket | None], jax.stages.Lowered]
# Called with each window phase's lowered step before it is compiled (the copy schedule
# hint's CopyScheduleHints.prepare, which writes the phase's latency profile).
Prepare = Callable[[jax.stages.Lowered], object]


class AotCheckError(AssertionError):
    """A window program would stall or grow device memory on the target."""


@dataclasses.dataclass(frozen=True)
class WindowReport:
    """The plain step and the K window phases of one train step, compiled for a target."""

    target: Target
    plan: CapturePlan
    plain: ProgramReport
    phases: tuple[ProgramReport, ...]
    reference: ProgramReport | None  # the user's step compiled without overlap_ckpt

    @property
    def plain_is_users_program(self) -> bool | None:
        return None if self.reference is None else self.plain.fingerprint == self.reference.fingerprint

    def violations(self, max_serialized_bytes: int = MAX_SERIALIZED_BYTES) -> list[str]:
        """What would hurt on the target, one sentence each naming the phase and the leaf."""
        found = []
        if self.plain_is_users_program is False:
            found.append("the plain step is not the user's program: its optimized HLO differs from the "
                         "step compiled without overlap_ckpt")
        for phase, program in enumerate(self.phases):
            found += _phase_violations(phase, program, self.plain, self.target, max_serialized_bytes)
        return found

    def check(self, max_serialized_bytes: int = MAX_SERIALIZED_BYTES) -> None:
        """Raise :class:`AotCheckError` listing every violation (nothing when clean)."""
        found = self.violations(max_serialized_bytes)
        if found:
            raise AotCheckError(f"window programs for {self.target.name} fail the check:\n  - "
                                + "\n  - ".join(found))


def _phase_violations(phase: int, program: ProgramReport, plain: ProgramReport, target: Target,
                      max_serialized_bytes: int) -> list[str]:
    """Nothing on the CPU target: its host memory is its device memory, so the outbox is a
    plain copy counted as device output, and there is no transfer to overlap."""
    if target.platform == "cpu":
        return []
    found = []
    if program.memory.host_output == 0:
        found.append(f"phase {phase}: the outbox stays in device memory (no output in host memory)")
    for copy in program.host_copies:
        if not copy.overlapped and copy.nbytes > max_serialized_bytes:
            found.append(f"phase {phase}: the copy of {copy.leaf} ({copy.nbytes / 2**20:.1f} MiB) is "
                         "serialized: no compute runs while it transfers")
    plain_copies = {c.leaf for c in plain.device_copies}
    new = [c for c in program.device_copies if c.leaf not in plain_copies]
    for copy in new:
        if copy.nbytes > MAX_DEVICE_COPY_BYTES:
            found.append(f"phase {phase}: {copy.leaf} ({copy.nbytes / 2**20:.1f} MiB) is copied within device "
                         "memory, which the plain step does not do")
    extra = program.memory.peak - plain.memory.peak
    if extra > program.memory.host_output + LAYOUT_ALLOWANCE_BYTES:
        named = ", ".join(f"{c.leaf} ({c.nbytes / 2**20:.1f} MiB)" for c in new) or "temporaries only"
        found.append(f"phase {phase}: {extra / 2**20:.1f} MiB more device memory than the plain step, beyond "
                     f"its {program.memory.host_output / 2**20:.1f} MiB outbox and "
                     f"{LAYOUT_ALLOWANCE_BYTES / 2**20:.0f} MiB of layout; device copies of: {named}")
    return found


def compile_window(lower: LowerStep, plan: CapturePlan, target: Target,
                   reference: jax.stages.Lowered | None = None, prepare: Prepare | None = None,
                   compiler_options: dict[str, str] | None = None) -> WindowReport:
    """Compile ``lower(None)`` (the plain step) and ``lower(ticket)`` for every phase of
    ``plan``, and ``reference`` (the user's step without overlap_ckpt) if given.

    ``lower(ticket)`` returns the step lowered for ``target``'s devices with the ticket
    in force, e.g. ``lambda t: step.lower(state_with(t), batch)`` for the functional core
    (``capture_update(tx, ticket, ...)`` inside the step) with abstract arguments
    (``jax.ShapeDtypeStruct`` with shardings on ``target.devices``): nothing is allocated.
    ``prepare(lowered)`` runs before each phase compiles (the copy schedule hint's profile).
    ``compiler_options``: added to the jit's for the plain step and the phases, not the
    reference (:func:`overlap_ckpt.aot.programs.compile_program`).
    """
    plain, _ = compile_program("plain step", lower(None), compiler_options)
    ref = compile_program("user step", reference)[0] if reference is not None else None
    phases = tuple(report for report, _ in compiled_phases(lower, plan, prepare, compiler_options))
    return WindowReport(target, plan, plain, phases, ref)


def compiled_phases(lower: LowerStep, plan: CapturePlan, prepare: Prepare | None = None,
                    compiler_options: dict[str, str] | None = None,
                    ) -> Iterator[tuple[ProgramReport, jax.stages.Compiled]]:
    """Each window phase of ``plan``, read, with its executable (which runs where the
    target's devices are here: ``overlap-ckpt aot --target gpu --measure``); ``prepare``
    and ``compiler_options``: see :func:`compile_window`."""
    for j in range(plan.k):
        lowered = lower(WindowTicket(plan, j))
        if prepare is not None:
            prepare(lowered)
        yield compile_program(f"phase {j} of {plan.k}", lowered, compiler_options)
