"""Predicted stall per checkpoint and ETTR on a target, from the compiled window programs.

Assumptions (printed with every prediction):

* step time ``T = max(flops / (peak * MFU), bytes_accessed / HBM bandwidth)``: the
  compiled plain step's cost analysis (per device) against the target's peak rate at an
  assumed model-FLOPs utilisation ``MFU`` and its HBM bandwidth; where the backend gives
  no cost analysis (XLA:GPU compile-only), the flops are the caller's (e.g. the standard
  transformer estimate) and the HBM term is left out;
* each phase's host copies (their bytes read from the compiled program) run at the host
  link's bandwidth, one at a time, each from where the compiled schedule starts it: the
  step's time runs with its matmul flops (:func:`overlap_ckpt.aot.hlo.scheduled_flops`),
  and the step waits at a copy's done until the copy has transferred
  (:func:`scheduled_stall_s`). XLA:GPU starts a large copy late in the step (0.68-0.72 of
  the 1B LM's compute on an H200), so this is the figure the default schedule gives; the
  ideal (every copy hides under ``f * T``, ``f``: overlappable fraction) is reported beside
  it, and ``window="auto"`` is predicted with the fraction the compiled copies get
  (:func:`schedule_fraction`) and, where the schedule serialized copies, the bytes it
  overlapped (:func:`schedule_capacity`);
* Orbax async blocks on a device-to-host copy of the whole state: ``stall = S / link``;
* host replay and persist run in the background and finish before the next checkpoint
  (not counted), so ``ETTR = N*T / (N*T + stall)``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax

from ..costmodel.model import TrainingProfile, predicted_step_time_s
from ..costmodel.window import MFU, CompiledSchedule, choose_window
from .hlo import HostCopy, entry_instructions, host_copies, scheduled_flops
from .programs import ProgramReport
from .targets import Target
from .window import MAX_SERIALIZED_BYTES, WindowReport

OVERLAPPABLE_FRACTION = TrainingProfile.overlappable_fraction  # the model's default for matmul-bound steps
BACKGROUND_BYTES_PER_S = 1e15  # "persist is not the bottleneck" (see the module docstring)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The plain step on the target, per device."""

    flops: float
    hbm_bytes: float | None
    step_time_s: float
    flops_source: str


def step_cost(report: WindowReport, flops_hint: float | None = None, mfu: float = MFU) -> StepCost:
    """Predicted step time of the plain step: its cost analysis where the backend gives
    one, else ``flops_hint`` (per device)."""
    target = report.target
    flops, source = report.plain.flops, "compiled cost analysis"
    if flops and target.platform == "gpu" and flops_hint:
        # XLA:GPU's analysis of the optimized program undercounts: the 1B LM's step on an
        # H200 (jax 0.11.2) counted 2.5-2.75e13 flops where 6N per token gives 1.03e14, its
        # matmuls being library calls by then.
        flops, source = flops_hint, (f"caller's estimate (XLA:GPU's cost analysis of the optimized program "
                                     f"counts {report.plain.flops:.3g}, which undercounts its library matmuls)")
    elif not flops:
        if flops_hint is None:
            raise ValueError(f"{target.name}'s compiler gives no cost analysis: pass flops_hint "
                             "(per-device flops of one step)")
        flops, source = flops_hint, "caller's estimate (no cost analysis from this compiler)"
    hbm = report.plain.bytes_accessed if report.plain.flops else None
    t = predicted_step_time_s(flops, target.peak_flops, mfu, hbm, target.hbm_bytes_per_s)
    return StepCost(flops, hbm, t, source)


def copy_bytes(report: WindowReport, phase: int) -> int:
    """Bytes phase ``phase`` moves to the host, per device (its outputs in host memory)."""
    return report.phases[phase].memory.host_output


def phase_stall_s(report: WindowReport, cost: StepCost, phase: int, f: float = OVERLAPPABLE_FRACTION,
                  *, as_scheduled: bool = True) -> float:
    """Stall of one window phase. ``as_scheduled``: the copies as the compiled schedule
    places them (:func:`scheduled_stall_s`); otherwise every copy may hide under ``f * T``
    (the model's ideal, what a schedule that starts every copy at the top would give)."""
    link = report.target.host_link_bytes_per_s
    program = report.phases[phase]
    if as_scheduled and program.matmul_flops:
        return scheduled_stall_s(program, cost.step_time_s, link)
    # No matmuls to place the copies by: a copy the schedule serializes stalls for its
    # whole transfer, the others hide under f * T.
    serialized = sum(c.nbytes for c in program.host_copies if not c.overlapped) if as_scheduled else 0
    hidden = copy_bytes(report, phase) - serialized
    return serialized / link + max(0.0, hidden / link - f * cost.step_time_s)


def scheduled_stall_s(program: ProgramReport, step_time_s: float, link_bytes_per_s: float) -> float:
    """The stall of one program's host copies where its schedule puts them: the step's time
    runs with its matmul flops (an instruction starts at ``T x`` the fraction of them before
    it), the copies take the host link one after another in the order they start, and the
    step waits at a copy's done until its transfer ends; a wait delays all that follows."""
    delay, link_free = 0.0, 0.0
    for copy in sorted(program.host_copies, key=lambda c: c.flops_before):
        start = step_time_s * copy.flops_before / program.matmul_flops + delay
        end = max(link_free, start) + copy.nbytes / link_bytes_per_s
        link_free = end
        done = step_time_s * (copy.flops_before + copy.flops_between) / program.matmul_flops + delay
        delay += max(0.0, end - done)
    return delay


def hide_fraction(copies: Sequence[HostCopy], matmul_flops: float) -> float | None:
    """The fraction of a step one compiled window phase's copies can hide under: the share of
    the step's matmul flops scheduled while at least one of its ``copies`` transfers (the
    union of their spans). Why the union: the copies share one host link, so bytes hide
    while any of them is in flight. On GPU that is the packed state copy's own span; XLA:TPU
    keeps a few copies in flight, each under a short stretch of the step, one after another
    across it (the 100M LM's largest single span is 5% of its step, their union nearly all).
    None where the phase has no matmuls to tell by or no copy to the host (the CPU, whose
    outbox is a copy within its one memory)."""
    if not (matmul_flops and copies):
        return None
    covered, reach = 0.0, 0.0
    for start, end in sorted((c.flops_before, c.flops_before + c.flops_between) for c in copies):
        covered += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return covered / matmul_flops


def overlapped_bytes(copies: Sequence[HostCopy]) -> float | None:
    """The bytes of ``copies`` (one compiled window phase's) that the schedule overlapped,
    where it serialized more than :data:`~overlap_ckpt.aot.window.MAX_SERIALIZED_BYTES` of
    them: what a step's compiled schedule will hide, whatever the time says
    (:attr:`overlap_ckpt.costmodel.model.TrainingProfile.schedule_capacity_bytes`). None
    where it serialized no more than that: the few small copies a phase may issue back to
    back stall for microseconds, not worth the gradient traffic of a longer window."""
    serialized = sum(c.nbytes for c in copies if not c.overlapped)
    if serialized <= MAX_SERIALIZED_BYTES:
        return None
    return float(sum(c.nbytes for c in copies if c.overlapped))


def phase_schedule(copies: Sequence[HostCopy], matmul_flops: float) -> CompiledSchedule:
    """What ``window="auto"`` reads from one compiled phase: :func:`hide_fraction` and
    :func:`overlapped_bytes`."""
    return CompiledSchedule(hide_fraction(copies, matmul_flops), overlapped_bytes(copies))


def compiled_schedule(compiled: jax.stages.Compiled) -> CompiledSchedule:
    """:func:`phase_schedule` of a phase compiled for the device it runs on, read from its
    scheduled program alone (``window="auto"`` reads it from the variants ``compile_ahead``
    compiled, which dumped nothing: :func:`overlap_ckpt.aot.programs.compile_program` is
    the tool's)."""
    text = compiled.as_text()
    flops = scheduled_flops(text)
    return phase_schedule(host_copies(entry_instructions(text), flops), sum(flops))


def schedule_fraction(report: WindowReport) -> float | None:
    """The fraction of a step the compiled window copies can hide under: the least of its
    phases' :func:`hide_fraction`. None where one of them has none."""
    fractions = [hide_fraction(p.host_copies, p.matmul_flops) for p in report.phases]
    if not fractions or None in fractions:
        return None
    return min(fractions)


def schedule_capacity(report: WindowReport) -> float | None:
    """The least of the compiled phases' :func:`overlapped_bytes` (None: no phase
    serialized more than a small copy's worth)."""
    capacities = [b for b in (overlapped_bytes(p.host_copies) for p in report.phases) if b is not None]
    return min(capacities, default=None)


def window_stall_s(report: WindowReport, cost: StepCost, f: float = OVERLAPPABLE_FRACTION,
                   *, as_scheduled: bool = True) -> float:
    """Stall of one checkpoint window: the sum of its phases' (:func:`phase_stall_s`)."""
    return sum(phase_stall_s(report, cost, j, f, as_scheduled=as_scheduled) for j in range(len(report.phases)))


def state_bytes_per_device(report: WindowReport) -> float:
    """Params and optimizer state on one device (this process's blocks over its devices)."""
    return report.plan.state_bytes / len(report.target.devices)


def grad_bytes_per_device(report: WindowReport) -> float:
    return report.plan.grad_bytes / len(report.target.devices)


def orbax_async_stall_s(report: WindowReport) -> float:
    return state_bytes_per_device(report) / report.target.host_link_bytes_per_s


def ettr(step_time_s: float, stall_s: float, interval_steps: int) -> float:
    useful = interval_steps * step_time_s
    return useful / (useful + stall_s)


def auto_k(report: WindowReport, cost: StepCost, interval_steps: int | None,
           f: float = OVERLAPPABLE_FRACTION, capacity_bytes: float | None = None) -> int:
    """What ``window="auto"`` chooses on the target: the same rule as on a device
    (:func:`overlap_ckpt.costmodel.window.choose_window`), with the predicted step time,
    ``f``, the fraction of a step a copy hides under (:func:`schedule_fraction` of a compiled
    window where there is one) and ``capacity_bytes``, what its schedule overlapped where it
    serialized the rest (:func:`schedule_capacity`). ``interval_steps=None``: the K of least
    stall per checkpoint (the report's "best")."""
    return choose_window(cost.step_time_s, report.target.host_link_bytes_per_s,
                         state_bytes_per_device(report), grad_bytes_per_device(report),
                         BACKGROUND_BYTES_PER_S, interval_steps, overlappable_fraction=f,
                         schedule_capacity_bytes=capacity_bytes)


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What ``window="auto"`` picks on the target, read from a compiled K=1 window."""

    by_interval: dict[int, int]  # checkpoint interval N -> K
    best: int  # the K of least stall per checkpoint
    fraction: float | None  # of a step K=1's compiled copies hide under (None: the model's constant was used)
    capacity_bytes: float | None = None  # what K=1's schedule overlapped where it serialized the rest

    def labels(self, first: str = "1") -> dict[int, str]:
        """K -> why it is compiled: K=1 (``first``), auto at each interval, the best."""
        whys: dict[int, list[str]] = {1: [first]}
        for k, why in [*((k, f"auto at N={n}") for n, k in self.by_interval.items()), (self.best, "best")]:
            whys.setdefault(k, []).append(why)
        return {k: ", ".join(w) for k, w in whys.items()}


def auto_choice(k1: WindowReport, cost: StepCost, intervals: Iterable[int]) -> AutoChoice:
    """The K ``window="auto"`` picks at each interval and the best K (:func:`auto_k`), from
    the fraction of a step the compiled K=1 window's copies hide under
    (:func:`schedule_fraction`; :data:`OVERLAPPABLE_FRACTION` where its programs have no
    matmuls to tell by). The one choice ``overlap-ckpt aot`` and ``CheckpointManager.aot_report``
    both report. Where K=1's schedule serialized copies, a step hides at most the bytes it
    overlapped (:func:`schedule_capacity`), so the choice moves to a K whose steps carry no
    more than that: XLA:TPU serializes what outnumbers the copies it keeps in flight."""
    fraction, capacity = schedule_fraction(k1), schedule_capacity(k1)
    f = OVERLAPPABLE_FRACTION if fraction is None else fraction
    return AutoChoice({n: auto_k(k1, cost, n, f, capacity) for n in intervals}, auto_k(k1, cost, None, f, capacity),
                      fraction, capacity)


def assumptions(target: Target, cost: StepCost, mfu: float = MFU, f: float = OVERLAPPABLE_FRACTION) -> list[str]:
    return [target.sources,
            f"step time {cost.step_time_s * 1e3:.3g} ms = max(flops / (peak x MFU {mfu}), bytes / HBM); "
            f"flops {cost.flops:.3g} per device from the {cost.flops_source}"
            + (f", {cost.hbm_bytes:.3g} bytes accessed" if cost.hbm_bytes else ""),
            "as scheduled: the step's time runs with its matmul flops; each copy starts where the compiled "
            "schedule starts it, the copies take the host link one at a time, and the step waits at a copy's "
            f"done until it has transferred; every copy overlapped: the copies hide under {f:.0%} of a step",
            "Orbax async: a blocking device-to-host copy of the whole state at the host link's bandwidth",
            "host replay and persist finish in the background before the next checkpoint (not counted)"]
