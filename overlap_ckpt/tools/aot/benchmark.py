"""``overlap-ckpt aot``: the benchmark LM's window programs for K in {1, auto, best} on a
target, compiled once each, and the markdown report of them."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax

from ...aot import predict
from ...aot.markdown import analysis_note, markdown, run_notes
from ...aot.programs import compile_program
from ...aot.targets import Target
from ...aot.window import WindowReport, compiled_phases
from ...manager.copy_schedule import CopyScheduleHints
from . import cpu_check, device_check
from .lm_step import LMSetup, lm_setup, lower_reference, lower_with, plan_window

@dataclasses.dataclass
class AotRun:
    """What one ``overlap-ckpt aot`` run compiled, growing one K at a time."""

    setup: LMSetup
    probe: WindowReport  # the plain and user steps, without phases
    cost: predict.StepCost
    labels: dict[int, str]  # K -> why it is compiled
    started: float
    plain_program: jax.stages.Compiled
    windows: dict[int, WindowReport] = dataclasses.field(default_factory=dict)
    # K -> its phases' executables, kept only where they will run (a gpu target, measured)
    phase_programs: dict[int, tuple[jax.stages.Compiled, ...]] = dataclasses.field(default_factory=dict)
    # What window="auto" read from K=1's compiled schedule (predict.auto_choice)
    choice: predict.AutoChoice | None = None
    # The copy schedule hint the step is jitted with (--copy-hints), else None
    hints: CopyScheduleHints | None = None

    def lower(self):
        """``lower(ticket)`` of the step as the user jits it (with the hint's options, if on)."""
        return lower_with(self.setup, self.hints.compiler_options() if self.hints else None)

    def plan(self, k: int):
        """The window plan of K steps: per-leaf copies with the copy schedule hint."""
        return plan_window(self.setup, k, pack_outbox=False if self.hints else None)

    def notes(self) -> list[str]:
        setup, target, plain = self.setup, self.probe.target, self.probe.plain
        hint = setup.train_flops() / len(target.devices)
        flops = (f"flops per device: {hint:.3g} by the 6N-per-token estimate, {plain.matmul_flops:.3g} in the "
                 f"scheduled program's matmuls, {analysis_note(plain)}")
        return [f"model: {setup.config.num_params() / 1e6:.0f}M parameters, bf16 compute, f32 params and Adam "
                f"moments (mixed precision), batch {setup.batch_size} x {setup.config.seq_len} tokens, FSDP over "
                f"{len(target.devices)} device(s)", flops,
                *run_notes(self.hints.compiler_options() if self.hints else None,
                           any("auto" in why for why in self.labels.values()),
                           self.choice.fraction if self.choice else None, time.perf_counter() - self.started,
                           self.choice.capacity_bytes if self.choice else None)]

    def markdown(self, model: str, intervals: list[int]) -> str:
        return markdown(model, self.windows, self.labels, self.cost, intervals, self.notes())


def aot_report(target: Target, model: str, ks: list[int] | None = None, intervals: tuple[int, ...] = (10, 50),
               batch_per_device: int = 4, log=print, measure: bool = False,
               on_progress: Callable[[str], None] = lambda text: None,
               profile_dir: str | None = None, copy_hints: bool = False) -> tuple[str, dict[int, WindowReport]]:
    """Compile and report. ``ks`` None: K=1, what ``window="auto"`` picks at each interval,
    and the best K of the model; else exactly these K. ``measure`` (a target whose devices
    are here: cpu or gpu): run the programs and set them beside the prediction.
    ``on_progress`` gets the report so far after each K (a 1B model on a TPU takes long to
    compile). ``profile_dir`` (gpu, measured): a profiler trace of the plain step and of
    each K's largest phase (see :func:`overlap_ckpt.tools.aot.device_check.calibrate`).
    ``copy_hints`` (GPU): the step jitted and its phases compiled with the copy schedule
    hint (:mod:`overlap_ckpt.manager.copy_schedule`)."""
    if measure and not target.local:
        raise ValueError(f"measuring runs the programs: target {target.name} is compile-only")
    run = _start(target, model, ks, intervals, batch_per_device, log, copy_hints)
    lower = run.lower()
    prepare = run.hints.prepare if run.hints else None
    keep = measure and target.platform == "gpu"
    pending = sorted(run.labels)
    while pending:
        k = pending.pop(0)
        plan = run.probe.plan if k == 1 else run.plan(k)
        compiled = list(compiled_phases(lower, plan, prepare))
        run.windows[plan.k] = dataclasses.replace(run.probe, plan=plan, phases=tuple(r for r, _ in compiled))
        if keep:
            run.phase_programs[plan.k] = tuple(program for _, program in compiled)
        run.labels.setdefault(plan.k, run.labels[k])
        log(f"K={plan.k}: {plan.k} phases compiled")
        if ks is None and k == 1:  # auto and best K read the schedule K=1 got
            _choose_from_schedule(run, intervals)
            pending = sorted(set(run.labels) - set(run.windows) - {k})
        on_progress(run.markdown(model, list(intervals)))
    text = run.markdown(model, list(intervals))
    if measure and target.platform == "cpu":
        text += "\n" + cpu_check.calibrate(run.setup, run.probe, run.cost).markdown()
    elif measure:
        log("running the programs on the device")
        text += "\n" + device_check.calibrate(run.setup, run.cost, run.plain_program, run.windows,
                                               run.phase_programs, log=log,
                                               profile_dir=profile_dir).markdown(intervals)
    return text, run.windows


def _start(target: Target, model: str, ks, intervals, batch_per_device: int, log,
           copy_hints: bool = False) -> AotRun:
    """The plain and user steps compiled, the step cost predicted and the K to compile chosen."""
    started = time.perf_counter()
    setup = lm_setup(target, model, batch_per_device)
    hints = CopyScheduleHints() if copy_hints else None
    options = hints.compiler_options() if hints else None
    plain, plain_program = compile_program("plain step", lower_with(setup, options)(None))
    log(f"plain step compiled in {plain.compile_s:.1f} s")
    reference, _ = compile_program("user step", lower_reference(setup))
    probe = WindowReport(target, plan_window(setup, 1, pack_outbox=False if hints else None), plain, (), reference)
    cost = predict.step_cost(probe, setup.train_flops() / len(target.devices))
    labels = {k: "given" for k in ks} if ks is not None else {1: "1"}
    return AotRun(setup, probe, cost, labels, started, plain_program, hints=hints)


def _choose_from_schedule(run: AotRun, intervals) -> None:
    """Add the K that ``window="auto"`` picks at each interval and the best K, from the
    schedule K=1 got (:func:`overlap_ckpt.aot.predict.auto_choice`)."""
    run.choice = predict.auto_choice(run.windows[1], run.cost, intervals)
    run.labels = run.choice.labels(run.labels[1])
