"""One compiled program, summarised: its host copies, device memory, cost and fingerprint."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import re
import tempfile
import time

import jax

from .hlo import (DeviceCopy, HostCopy, Instruction, device_copies, device_temp_bytes, entry_instructions,
                  host_copies, scheduled_flops)
from .outbox import output_labels


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A compiled program's device memory, per device, in bytes: ``memory_analysis()``'s
    arguments, outputs and aliases, and the temporaries of XLA's buffer assignment (see
    :func:`compile_program`)."""

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
    matmul_flops: float = 0.0  # per device, summed over the schedule (:func:`overlap_ckpt.aot.hlo.scheduled_flops`)

    def after_start(self, copy: HostCopy) -> float:
        """The fraction of the step's matmul flops scheduled after ``copy`` starts: how much
        of the step it can hide under, at most (0 where the program has no matmuls)."""
        return 1.0 - copy.flops_before / self.matmul_flops if self.matmul_flops else 0.0

    def between(self, copy: HostCopy) -> float:
        """The fraction of the step's matmul flops scheduled while ``copy`` transfers."""
        return copy.flops_between / self.matmul_flops if self.matmul_flops else 0.0


def compile_program(name: str, lowered: jax.stages.Lowered,
                    compiler_options: dict[str, str] | None = None) -> tuple[ProgramReport, jax.stages.Compiled]:
    """Compile ``lowered`` for its (possibly compile-only) devices and read the result.
    ``compiler_options``: added to those of the step's ``jax.jit`` (XLA compiles with both,
    as it would had the jit been given them: the copy schedule hint's, for a step jitted
    on a machine where ``CheckpointManager.jit_compiler_options()`` returns none).

    The device temporaries come from the compiler's buffer assignment, dumped for this one
    compilation, rather than from ``memory_analysis().temp_size_in_bytes``: on TPU that
    figure is not the device memory the program reserves (compile-only v5e:2x2, tiny LM:
    0 for a plain step whose buffer assignment holds 5.3 MB of device temporaries, and
    10.6 MB for a window phase holding 5.6 MB, on-chip VMEM being counted once host memory
    is involved). On GPU and CPU the two agree.
    """
    with tempfile.TemporaryDirectory(prefix="overlap-ckpt-aot-") as dump:
        started = time.perf_counter()
        options = {**(compiler_options or {}), "xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        compiled = lowered.compile(compiler_options=options)
        seconds = time.perf_counter() - started
        assignments = glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt"))
        if not assignments and jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache:
            raise RuntimeError(
                f"{name} was not compiled but loaded from JAX's persistent compilation cache "
                f"({jax.config.jax_compilation_cache_dir}), so the compiler dumped nothing to read. "
                "Call jax.config.update('jax_enable_compilation_cache', False) before this process "
                "compiles anything (`overlap-ckpt aot` does).")
        if len(assignments) != 1:
            raise RuntimeError(f"expected one buffer assignment dump for {name}, found {len(assignments)} in {dump}")
        with open(assignments[0]) as f:
            temp = device_temp_bytes(f.read())
    text = compiled.as_text()
    instructions = entry_instructions(text)
    flops = scheduled_flops(text)
    m = compiled.memory_analysis()
    memory = DeviceMemory(m.argument_size_in_bytes, m.output_size_in_bytes, temp,
                          m.alias_size_in_bytes, m.host_output_size_in_bytes)
    cost = _cost(compiled)
    copies = host_copies(instructions, flops, outputs_of(lowered, instructions))
    report = ProgramReport(name, memory, tuple(copies), tuple(device_copies(instructions)),
                           cost.get("flops"), cost.get("bytes accessed"), fingerprint(text), seconds, sum(flops))
    return report, compiled


def outputs_of(lowered: jax.stages.Lowered, instructions: list[Instruction]) -> list | None:
    """What each of the program's outputs is (:func:`overlap_ckpt.aot.outbox.output_labels`),
    when the compiled program has as many outputs as the step returns leaves (jit passes
    them in flattened order); else None (the copies are named by what they read). An
    ``nnx.jit`` step's ``Lowered`` wraps jax's, whose outputs are the step's graph state and
    return value: read from that one."""
    try:
        labels = output_labels(getattr(lowered, "lowered", lowered).out_info)
    except Exception:  # noqa: BLE001 - an output tree this module cannot read: no labels
        return None
    root = next((i for i in reversed(instructions) if i.root), None)
    arity = 0 if root is None else len(root.operands) if root.opcode == "tuple" else 1
    return labels if arity == len(labels) else None


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
