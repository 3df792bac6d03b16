"""The ``overlap-ckpt aot`` report as markdown: programs, copies, memory, prediction.

On this floor, not with the command (``overlap_ckpt.tools.aot``): the report reads only
compiled window programs and their prediction, and ``CheckpointManager.aot_report`` renders
a user's own step with it (:mod:`overlap_ckpt.aot.step_report`)."""

from __future__ import annotations

import dataclasses

from . import predict
from .programs import ProgramReport
from .window import WindowReport

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Prediction:
    label: str  # "Orbax async", "K=1", "K=auto (N=10)", ...
    stall_s: float
    ideal_stall_s: float  # every copy overlapped
    ettr: dict[int, float]  # interval N -> ETTR, as scheduled


def predictions(windows: dict[int, WindowReport], labels: dict[int, str], cost: predict.StepCost,
                intervals: list[int]) -> list[Prediction]:
    """Orbax async, then one row per compiled K (``labels[k]`` says why it was compiled)."""
    any_report = next(iter(windows.values()))
    orbax = predict.orbax_async_stall_s(any_report)
    rows = [Prediction("Orbax async (blocking copy of the state)", orbax, orbax,
                       {n: predict.ettr(cost.step_time_s, orbax, n) for n in intervals})]
    for k, report in sorted(windows.items()):
        stall = predict.window_stall_s(report, cost)
        ideal = predict.window_stall_s(report, cost, as_scheduled=False)
        rows.append(Prediction(f"overlap K={k} ({labels[k]})", stall, ideal,
                               {n: predict.ettr(cost.step_time_s, stall, n) for n in intervals if n >= k}))
    return rows


def program_rows(plain: ProgramReport, program: ProgramReport) -> str:
    copies = program.host_copies
    overlapped = [c for c in copies if c.overlapped]
    serialized = [c for c in copies if not c.overlapped]
    queues = ",".join(sorted({c.queue for c in copies if c.queue})) or "-"
    extra = program.memory.peak - plain.memory.peak
    new_copies = {c.leaf for c in program.device_copies} - {c.leaf for c in plain.device_copies}
    return (f"| {program.name} | {len(copies)} | {sum(c.asynchronous for c in copies)} | {queues} | "
            f"{len(overlapped)} ({sum(c.nbytes for c in overlapped) / MIB:.1f} MiB) | "
            f"{len(serialized)} ({sum(c.nbytes for c in serialized) / MIB:.1f} MiB) | "
            f"{max((c.compute_between for c in copies), default=0)} | "
            f"{program.memory.host_output / MIB:.1f} | {program.memory.peak / MIB:.0f} | {extra / MIB:+.1f} | "
            f"{len(new_copies)} | {program.compile_s:.1f} |")


def copy_rows(program: ProgramReport, shown: int = 8) -> list[str]:
    copies = sorted((c for c in program.host_copies if c.nbytes >= MIB), key=lambda c: c.flops_before)
    rows = [f"| {program.name} | {c.leaf} | {c.nbytes / MIB:.1f} | "
            + (f"{program.after_start(c):.2f} | {program.between(c):.2f} |" if program.matmul_flops else "- | - |")
            for c in copies[:shown]]
    if len(copies) > shown:
        rows.append(f"| {program.name} | ... and {len(copies) - shown} more | "
                    f"{sum(c.nbytes for c in copies[shown:]) / MIB:.1f} | | |")
    return rows


def kind_rows(program: ProgramReport) -> list[str]:
    """Per kind of copy (what its output in the outbox is: overlap_ckpt.aot.outbox), how many,
    their bytes, how many serialized, and the latest and earliest start (*after start*)."""
    rows = []
    for kind in sorted({c.kind for c in program.host_copies}):
        copies = [c for c in program.host_copies if c.kind == kind]
        after = [program.after_start(c) for c in copies] if program.matmul_flops else []
        rows.append(f"| {program.name} | {kind or 'unlabelled'} | {len(copies)} | "
                    f"{sum(c.nbytes for c in copies) / MIB:.1f} | {sum(not c.overlapped for c in copies)} | "
                    + (f"{min(after):.2f} | {max(after):.2f} |" if after else "- | - |"))
    return rows


def run_notes(hint_options: dict[str, str] | None, chose_auto: bool, fraction: float | None,
              seconds: float, capacity_bytes: float | None = None) -> list[str]:
    """The notes every report ends with: the copy schedule hint (its compiler options, when
    on), how ``window="auto"`` chose (:func:`predict.auto_choice`, when it did) and the time
    the compiles took."""
    return [*([] if hint_options is None else [
                "copy schedule hint on (`CheckpointManager.jit_compiler_options()`): the step's jit carries "
                + ", ".join(f"`{key}`" for key in hint_options)
                + "; one host copy per leaf; every capturing phase compiled once on the side for its "
                  "latency profile (as `compile_ahead` does)"]),
            *([] if not chose_auto else [
                "window=\"auto\" and the best K chosen with copies hiding under "
                + (f"{fraction:.0%} of a step, the share of the step's matmul flops K=1's compiled copies "
                   "transfer under" if fraction is not None else
                   f"{predict.OVERLAPPABLE_FRACTION:.0%} of a step (no matmuls to read the schedule by)")
                + ("" if capacity_bytes is None else
                   f", and at most {capacity_bytes / MIB:.1f} MiB of copies per step: what K=1's schedule "
                   "overlapped, having serialized the rest")]),
            f"compiled on this machine from abstract inputs in {seconds:.0f} s"]


def analysis_note(plain: ProgramReport) -> str:
    """The plain step's flops by the compiler's cost analysis, where it gives one."""
    return f"{plain.flops:.3g} by the compiler's cost analysis" if plain.flops else "no cost analysis from this compiler"


def markdown(model: str, windows: dict[int, WindowReport], labels: dict[int, str], cost: predict.StepCost,
             intervals: list[int], notes: list[str]) -> str:
    """The whole report for one target (the programs of every compiled K)."""
    first = next(iter(windows.values()))
    target, plain = first.target, first.plain
    where = "this machine's" if target.local else "compile-only"
    lines = [f"# overlap-ckpt aot: {model} on {target.name} ({len(target.devices)} device(s), {where})", ""]
    lines += [f"- {n}" for n in notes]
    verdict = {None: "not compared", True: "yes", False: "NO"}[first.plain_is_users_program]
    lines += [f"- plain step's optimized HLO equals the user's step compiled without overlap_ckpt: **{verdict}** "
              f"(fingerprint {plain.fingerprint})",
              f"- state per device: {predict.state_bytes_per_device(first) / 2**30:.2f} GiB, gradient "
              f"{predict.grad_bytes_per_device(first) / 2**30:.2f} GiB; plain step device memory "
              f"{plain.memory.peak / 2**30:.2f} GiB (argument {plain.memory.argument / 2**30:.2f}, output "
              f"{plain.memory.output / 2**30:.2f}, temp {plain.memory.temp / 2**30:.2f}, alias "
              f"{plain.memory.alias / 2**30:.2f}); compiled in {plain.compile_s:.1f} s", "",
              "## Programs", "",
              "Per device. *overlapped*: a copy-start/copy-done pair to host memory with compute scheduled "
              "between; *serialized*: nothing computes while it transfers. *extra*: device memory "
              "(argument + output - alias + temp) beyond the plain step; *new dev copies*: arguments copied "
              "within device memory that the plain step does not copy.", "",
              "| program | host copies | async | queues | overlapped | serialized | max compute ops between | "
              "outbox MiB | device MiB | extra MiB | new dev copies | compile s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|",
              program_rows(plain, plain)]
    for k, report in sorted(windows.items()):
        lines += [program_rows(plain, p) for p in report.phases]
    lines += ["", "## Where the copies start", "",
              "Per phase, its copies of at least 1 MiB in the order they start. *after start*: the share of the "
              "step's matmul flops scheduled after the copy starts (1.00: at the top of the step); *during*: "
              "the share scheduled while it transfers, what it can hide under.", "",
              "| program | copy | MiB | after start | during |", "|---|---|---|---|---|"]
    for k, report in sorted(windows.items()):
        lines += [row for p in report.phases for row in copy_rows(p)]
    lines += ["", "By what the copies carry (the outbox's state items, gradient pieces, scalars), every copy "
              "whatever its size: *latest start* and *earliest start* are the least and the most *after start*.",
              "", "| program | carries | copies | MiB | serialized | latest start | earliest start |",
              "|---|---|---|---|---|---|---|"]
    for k, report in sorted(windows.items()):
        lines += [row for p in report.phases for row in kind_rows(p)]
    lines += ["", "## Checks", ""]
    for k, report in sorted(windows.items()):
        found = report.violations()
        lines.append(f"- K={k}: " + ("pass" if not found else f"**{len(found)} violation(s)**"))
        lines += [f"  - {v}" for v in found[:8]]
        if len(found) > 8:
            lines.append(f"  - ... and {len(found) - 8} more")
    rows = predictions(windows, labels, cost, intervals)
    lines += ["", "## Predicted stall per checkpoint and ETTR", "",
              "| strategy | stall s (as scheduled) | stall s (every copy overlapped) | "
              + " | ".join(f"ETTR N={n}" for n in intervals) + " |",
              "|---|---|---|" + "---|" * len(intervals)]
    for r in rows:
        ettrs = " | ".join(f"{r.ettr[n]:.4f}" if n in r.ettr else "-" for n in intervals)
        lines.append(f"| {r.label} | {r.stall_s:.3g} | {r.ideal_stall_s:.3g} | {ettrs} |")
    lines += ["", "Assumptions:", ""] + [f"- {a}" for a in predict.assumptions(target, cost)]
    return "\n".join(lines) + "\n"
