"""Reading a compiled program's schedule: its host copies and its extra device copies.

Why the text: ``compiled.as_text()`` is the *scheduled* HLO module, the instruction order
the device runs (XLA's own tools check programs the same way). A device-to-host copy is
asynchronous when it is a ``copy-start``/``copy-done`` pair whose result lives in host
memory (memory space ``S(5)``), and it overlaps compute when the scheduler put compute
(fusions, library calls, loops) between the two. A plain ``copy`` into ``S(5)``, or a pair
with nothing between, stalls the step for the whole transfer.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import numpy as np

HOST_SPACE = "S(5)"  # XLA's memory space of host memory, on GPU and TPU alike
# Instructions that do a step's work; everything else (tuples, bitcasts, parameters,
# copies, collectives' bookkeeping) is plumbing.
COMPUTE_OPCODES = frozenset({"fusion", "custom-call", "convolution", "dot", "while", "conditional", "call"})
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
                "s4": 1, "u4": 1}
# What a device copy of an argument may read instead of the parameter itself: a view of it
# (a packed outbox of one whole leaf is a bitcast of it, see overlap_ckpt.core.packing), or
# the TPU's copy of it into another on-chip memory space.
_VIEWS = frozenset({"bitcast", "bitcast-convert", "reshape", "copy"})
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_NAME = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_QUEUE = re.compile(r'"operation_queue_id":"(\d+)"')
# "allocation 306: size 5259776, preallocated-temp:" (device memory: no color, or color 0);
# newer XLA (jax 0.11) writes "allocation 549: size 262293024, page 0, preallocated-temp:".
_TEMP_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), ((?:[a-z]+ \d+, )*)preallocated-temp:", re.M)
_COLOR = re.compile(r"\bcolor (\d+)")
# What a fusion, call, loop or conditional runs: the computations it names.
_CALLED = re.compile(r"\b(?:calls|to_apply|body|branch_computations)=\{?((?:%[\w.\-]+(?:, )?)+)\}?")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([0-9,]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_DIM_LABELS = re.compile(r"\bdim_labels=\w+_(\w+)->")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # the result type as printed (a tuple for copy-start)
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    root: bool = False  # the computation's ROOT (a program's outputs, a tuple for several)

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.attributes)
        return m.group(1).replace("\\'", "'").replace("\\\\", "\\") if m else ""


@dataclasses.dataclass(frozen=True)
class HostCopy:
    """One device-to-host transfer of a compiled program."""

    leaf: str  # the argument it reads (the train state's leaf), or the op that made the value
    nbytes: int  # per device
    asynchronous: bool  # a copy-start/copy-done pair (False: one blocking copy)
    queue: str  # GPU stream (operation_queue_id); "" where the backend does not say
    compute_between: int  # compute instructions scheduled between start and done
    compute_before: int = 0  # compute instructions scheduled before the start
    name: str = ""  # the copy-start's (or the blocking copy's) instruction name
    flops_before: float = 0.0  # the step's matmul flops scheduled before the start
    flops_between: float = 0.0  # ... between the start and the done (what the copy can hide under)
    # What it carries, where the program's outputs say (overlap_ckpt.aot.outbox: "state",
    # "gradients", "scalars"); "" where they were not given or the copy is not one of them.
    kind: str = ""

    @property
    def overlapped(self) -> bool:
        return self.asynchronous and self.compute_between > 0


@dataclasses.dataclass(frozen=True)
class DeviceCopy:
    """A copy of a program argument into device memory (e.g. a donated leaf kept alive)."""

    leaf: str
    nbytes: int


def entry_instructions(hlo_text: str) -> list[Instruction]:
    """The entry computation's instructions, in schedule order."""
    lines = hlo_text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("ENTRY")), None)
    if start is None:
        raise ValueError("not an HLO module: no ENTRY computation")
    out = []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        parsed = _parse(line)
        if parsed is not None:
            out.append(parsed)
    return out


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
    """Every computation of the module by name (the entry's too), its instructions in order."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in hlo_text.splitlines():
        if line.endswith("{") and line[:1] not in ("", " ") and not line.startswith("HloModule"):
            name = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
            current = out.setdefault(name, [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            parsed = _parse(line)
            if parsed is not None:
                current.append(parsed)
    return out


def scheduled_flops(hlo_text: str) -> list[float]:
    """The matmul flops of each instruction of the entry computation, in schedule order
    (:func:`entry_instructions`): its dots and library GEMMs, those of the fusions, loops
    (times their known trip count) and calls it runs included.

    Why matmuls only: where a copy starts is worth the step's time after it, and a train
    step's time is its matmuls' (a transformer's elementwise work is a few percent of its
    flops); counting instructions instead gives a layer norm the weight of a 2 GFLOP
    projection. A program without matmuls gets zeros (the caller falls back to counts)."""
    comps = computations(hlo_text)

    @functools.lru_cache(maxsize=None)
    def computation_flops(name: str) -> float:
        instructions = comps.get(name, [])
        shapes = {i.name: i.shape for i in instructions}
        return sum(instruction_flops(i, shapes, computation_flops) for i in instructions)

    entry = entry_instructions(hlo_text)
    shapes = {i.name: i.shape for i in entry}
    return [instruction_flops(i, shapes, computation_flops) for i in entry]


def instruction_flops(ins: Instruction, shapes: dict[str, str], computation_flops) -> float:
    """Flops of one instruction: ``2 * output elements * contracted size`` for a dot or a
    GEMM library call (operand shapes from ``shapes``, the instruction's computation), the
    computations it calls for the others (a loop's body times its known trip count, the
    dearest branch of a conditional)."""
    if ins.opcode == "convolution":  # XLA:TPU writes its matmuls as convolutions
        return 2.0 * _elements(ins.shape) * _convolution_window(ins, shapes)
    if ins.opcode == "dot" or (ins.opcode == "custom-call" and _is_gemm(ins)):
        contracting = (_CONTRACTING if ins.opcode == "dot" else _GEMM_CONTRACTING).search(ins.attributes)
        lhs = shapes.get(ins.operands[0], "") if ins.operands else ""
        if contracting is None or not lhs:
            return 0.0
        dims = _dims(lhs)
        contracted = int(np.prod([dims[int(d.strip('" '))] for d in contracting.group(1).split(",") if d.strip('" ')],
                                 dtype=np.int64))
        return 2.0 * _elements(ins.shape) * contracted
    called = _CALLED.search(ins.attributes)
    if called is None:
        return 0.0
    names = [n.strip().lstrip("%") for n in called.group(1).split(",") if n.strip()]
    costs = [computation_flops(n) for n in names]
    if ins.opcode == "while":
        trips = _TRIP_COUNT.search(ins.attributes)
        return costs[0] * (int(trips.group(1)) if trips else 1)
    return max(costs) if ins.opcode == "conditional" else sum(costs)


def _is_gemm(ins: Instruction) -> bool:
    """A library matmul (``__cublas$gemm``, ``__cublas$lt$matmul``, cuDNN's GEMM fusions)."""
    found = _TARGET.search(ins.attributes)
    return found is not None and ("gemm" in found.group(1).lower() or "matmul" in found.group(1).lower())


def _convolution_window(ins: Instruction, shapes: dict[str, str]) -> int:
    """Multiply-adds per output element of a convolution: the kernel's input features
    times its spatial window (``dim_labels=b01f_01io->b01f``: the kernel's ``i`` and digits)."""
    labels = _DIM_LABELS.search(ins.attributes)
    kernel = shapes.get(ins.operands[1], "") if len(ins.operands) > 1 else ""
    if labels is None or not kernel:
        return 0
    dims = _dims(kernel)
    return int(np.prod([size for size, label in zip(dims, labels.group(1)) if label == "i" or label.isdigit()],
                       dtype=np.int64))


def _elements(shape: str) -> int:
    return int(np.prod(_dims(shape), dtype=np.int64))


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _parse(line: str) -> Instruction | None:
    text = line.strip()
    root = text.startswith("ROOT ")
    if root:
        text = text[5:]
    if not text.startswith("%") or " = " not in text:
        return None
    name, rest = text[1:].split(" = ", 1)
    shape, rest = _take_type(rest)
    opcode, _, rest = rest.partition("(")
    operands, attributes = _take_group(rest)
    return Instruction(name, shape, opcode.strip(), tuple(_NAME.findall(operands)), attributes, root)


def _take_type(text: str) -> tuple[str, str]:
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    body, rest = _take_group(text[1:])
    return f"({body})", rest.lstrip()


def _take_group(text: str) -> tuple[str, str]:
    """``text`` after an opening parenthesis: (the group's body, what follows it)."""
    depth = 1
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[:i], text[i + 1:]
    return text, ""


def array_bytes(shape: str) -> int:
    """Bytes of the first array in a printed type (``f32[256,1024]{1,0:S(5)}``)."""
    m = _ARRAY.search(shape)
    if m is None:
        return 0
    dims = [int(d) for d in m.group(2).split(",") if d]
    return int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES.get(m.group(1), 4)


def _first_array(shape: str) -> str:
    """The first element of a tuple type (a copy-start's destination)."""
    return shape[1:].split("}", 1)[0] if shape.startswith("(") else shape


def host_copies(instructions: list[Instruction], flops: Sequence[float] | None = None,
                outputs: Sequence[tuple[str, str]] | None = None) -> list[HostCopy]:
    """Every transfer into host memory, with the compute scheduled while it runs;
    ``flops``: each instruction's (:func:`scheduled_flops`), for the flops around each copy;
    ``outputs``: ``(kind, name)`` of each of the program's outputs in order
    (:func:`overlap_ckpt.aot.outbox.output_labels`), which name a copy by the output it lands
    in. Without them, or for a copy that lands in none, the copy is named by what it reads
    (:func:`source_leaf`)."""
    by_name = {i.name: i for i in instructions}
    position = {i.name: n for n, i in enumerate(instructions)}
    done_of = {i.operands[0]: i for i in instructions if i.opcode == "copy-done" and i.operands}
    landing = output_positions(instructions) if outputs is not None else {}
    before_flops = np.concatenate([[0.0], np.cumsum(flops if flops is not None else np.zeros(len(instructions)))])

    def label(ins: Instruction, result: Instruction) -> tuple[str, str]:
        out = landing.get(result.name)
        if outputs is not None and out is not None and out < len(outputs) and outputs[out][0]:
            return outputs[out]
        return "", source_leaf(ins, by_name)

    copies = []
    for n, ins in enumerate(instructions):
        if ins.opcode == "copy-start" and HOST_SPACE in _first_array(ins.shape):
            done = done_of.get(ins.name)
            end = position[done.name] if done is not None else len(instructions)
            between = sum(i.opcode in COMPUTE_OPCODES for i in instructions[n + 1:end])
            before = sum(i.opcode in COMPUTE_OPCODES for i in instructions[:n])
            queue = _QUEUE.search(ins.attributes)
            kind, leaf = label(ins, done or ins)
            copies.append(HostCopy(leaf, array_bytes(ins.shape), True,
                                   queue.group(1) if queue else "", between, before, ins.name,
                                   float(before_flops[n]), float(before_flops[end] - before_flops[n + 1]), kind))
        elif ins.opcode == "copy" and HOST_SPACE in ins.shape:
            before = sum(i.opcode in COMPUTE_OPCODES for i in instructions[:n])
            kind, leaf = label(ins, ins)
            copies.append(HostCopy(leaf, array_bytes(ins.shape), False, "", 0, before, ins.name,
                                   float(before_flops[n]), kind=kind))
    return copies


# What may stand between a copy's result and the program's output tuple: views of it.
_TO_OUTPUT = frozenset({"bitcast", "reshape", "copy"})


def output_positions(instructions: list[Instruction]) -> dict[str, int]:
    """The program output each instruction's value is, by position in the ROOT tuple (0 for
    a ROOT that is not a tuple): the ROOT's operands and the views (bitcast, reshape, copy)
    they are of, followed back one operand at a time."""
    root = next((i for i in reversed(instructions) if i.root), None)
    if root is None:
        return {}
    by_name = {i.name: i for i in instructions}
    heads = list(enumerate(root.operands)) if root.opcode == "tuple" else [(0, root.name)]
    out: dict[str, int] = {}
    for index, name in heads:
        ins = by_name.get(name)
        while ins is not None and ins.name not in out:
            out[ins.name] = index
            ins = _through(ins, by_name)
    return out


_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")


def _through(ins: Instruction, by_name: dict[str, Instruction]) -> Instruction | None:
    """The value ``ins`` passes on unchanged: a view's operand, or the element a
    ``get-tuple-element`` takes of a tuple (through an optimization barrier of it, which
    the window step puts between its captures and the update); None for anything else."""
    if ins.opcode in _TO_OUTPUT and len(ins.operands) == 1:
        return by_name.get(ins.operands[0])
    if ins.opcode != "get-tuple-element" or not ins.operands:
        return None
    index = _TUPLE_INDEX.search(ins.attributes)
    src = by_name.get(ins.operands[0])
    if src is not None and src.opcode == "opt-barrier" and src.operands:
        src = by_name.get(src.operands[0])
    if index is None or src is None or src.opcode != "tuple" or int(index.group(1)) >= len(src.operands):
        return None
    return by_name.get(src.operands[int(index.group(1))])


def device_copies(instructions: list[Instruction]) -> list[DeviceCopy]:
    """Copies of whole arguments within device memory: XLA keeps a donated input alive
    this way when something still reads it after the output that reuses its buffer."""
    by_name = {i.name: i for i in instructions}
    out = []
    for ins in instructions:
        if ins.opcode in ("copy", "copy-start") and HOST_SPACE not in _first_array(ins.shape) and ins.operands:
            src = by_name.get(ins.operands[0])
            while src is not None and src.opcode in _VIEWS and src.operands:
                src = by_name.get(src.operands[0])
            if src is not None and src.opcode == "parameter" and "S(" not in _first_array(ins.shape):
                out.append(DeviceCopy(src.op_name or src.name, array_bytes(ins.shape)))
    return out


def source_leaf(ins: Instruction, by_name: dict[str, Instruction], depth: int = 8) -> str:
    """The argument a copy reads (through slices, bitcasts and fusions of it), named by
    its path in the step's arguments; else the operation that produced the value. A copy of
    several values concatenated (a packed outbox, overlap_ckpt.core.packing), behind views
    or not, is called a packed outbox, after the first of them.

    This is a guess from the operand chain: a gradient's chain may lead to a parameter, so
    a window program's copies are named from its outbox instead where it is known
    (``outputs`` of :func:`host_copies`)."""
    src = by_name.get(ins.operands[0]) if ins.operands else None
    while src is not None and src.opcode in _VIEWS and len(src.operands) == 1:
        src = by_name.get(src.operands[0])
    if src is not None and src.opcode in ("fusion", "concatenate") and len(src.operands) > 1:
        return f"a packed outbox ({_first_leaf(ins, by_name, depth)}, ...)"
    return _first_leaf(ins, by_name, depth)


def _first_leaf(ins: Instruction, by_name: dict[str, Instruction], depth: int) -> str:
    current = ins
    for _ in range(depth):
        if not current.operands:
            break
        src = by_name.get(current.operands[0])
        if src is None:
            break
        if src.opcode == "parameter":
            return src.op_name or src.name
        current = src
    return current.op_name or current.name


def device_temp_bytes(buffer_assignment: str) -> int:
    """The temporaries a program reserves in device memory, from XLA's buffer assignment
    dump (``*after_optimizations-buffer-assignment.txt``): its preallocated temp blocks in
    memory space 0. The other spaces are on-chip scratch (TPU VMEM, SMEM) or host memory
    (5), which the outbox is counted in."""
    total = 0
    for size, attributes in _TEMP_ALLOCATION.findall(buffer_assignment):
        color = _COLOR.search(attributes)
        if color is None or color.group(1) == "0":
            total += int(size)
    return total
