"""One compiled program, summarised: its host copies, device memory, cost and fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import time

import jax

from .hlo import DeviceCopy, HostCopy, device_copies, entry_instructions, host_copies


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """``compiled.memory_analysis()`` in device memory, per device, in bytes."""

    argument: int
    output: int
    temp: int
    alias: int
    host_output: int

    @property
    def peak(self) -> int:
        """Live device bytes while the program runs: arguments, outputs not written in
        place of a donated argument, and temporaries."""
        return self.argument + self.output - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    name: str
    memory: DeviceMemory
    host_copies: tuple[HostCopy, ...]
    device_copies: tuple[DeviceCopy, ...]
    flops: float | None  # per device, from the backend's cost analysis (None: not provided)
    bytes_accessed: float | None
    fingerprint: str
    compile_s: float


def compile_program(name: str, lowered: jax.stages.Lowered) -> tuple[ProgramReport, jax.stages.Compiled]:
    """Compile ``lowered`` for its (possibly compile-only) devices and read the result."""
    started = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - started
    text = compiled.as_text()
    instructions = entry_instructions(text)
    m = compiled.memory_analysis()
    memory = DeviceMemory(m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes,
                          m.alias_size_in_bytes, m.host_output_size_in_bytes)
    cost = _cost(compiled)
    report = ProgramReport(name, memory, tuple(host_copies(instructions)), tuple(device_copies(instructions)),
                           cost.get("flops"), cost.get("bytes accessed"), fingerprint(text), seconds)
    return report, compiled


def _cost(compiled: jax.stages.Compiled) -> dict:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older jax: one dict per program
        analysis = analysis[0] if analysis else None
    return dict(analysis or {})


_METADATA = re.compile(r",? ?metadata=\{[^}]*\}")
_MODULE = re.compile(r"^HloModule \S+")
_SOURCE_TABLES = frozenset({"FileNames", "FunctionNames", "FileLocations", "StackFrames"})


def program_text(hlo_text: str) -> str:
    """The optimized program without what comes from Python rather than from XLA: the
    module name, per-instruction source metadata and the source tables they point into."""
    kept, skipping = [], False
    for line in hlo_text.splitlines():
        if line.strip() in _SOURCE_TABLES:
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(_METADATA.sub("", line))
    return _MODULE.sub("HloModule m", "\n".join(kept), count=1)


def fingerprint(hlo_text: str) -> str:
    """A digest of :func:`program_text`: a step compiled inside a wrapper and the same
    step compiled alone compare equal exactly when XLA made the same program of them."""
    return hashlib.sha256(program_text(hlo_text).encode()).hexdigest()[:16]
