"""``overlap-ckpt aot``: the benchmark LM's window programs for K in {1, auto, best} on a
target, compiled once each, and the markdown report of them."""

from __future__ import annotations

import time

from .. import costmodel
from . import predict
from .cpu_check import calibrate
from .lm_step import lm_setup, lower_reference, lower_with, plan_window
from .programs import compile_program
from .report import markdown
from .targets import Target
from .window import WindowReport, compile_phases

MAX_K = 16


def best_k(report: WindowReport, cost: predict.StepCost) -> int:
    """The K of least predicted stall (the cost model's, with every copy overlapped)."""
    profile = costmodel.TrainingProfile(
        step_time_s=cost.step_time_s, d2h_bytes_per_s=report.target.host_link_bytes_per_s,
        state_bytes=predict.state_bytes_per_device(report), grad_bytes=predict.grad_bytes_per_device(report),
        persist_bytes_per_s=predict.BACKGROUND_BYTES_PER_S, overlappable_fraction=predict.OVERLAPPABLE_FRACTION)
    return costmodel.choose_k(profile, max_k=MAX_K)


def aot_report(target: Target, model: str, ks: list[int] | None = None, intervals: tuple[int, ...] = (10, 50),
               batch_per_device: int = 4, log=print, measure: bool = False) -> tuple[str, dict[int, WindowReport]]:
    """Compile and report. ``ks`` None: K=1, what ``window="auto"`` picks at each interval,
    and the best K of the model; else exactly these K. ``measure`` (cpu target only): run
    the step and a blocking state copy and set them beside the prediction."""
    started = time.perf_counter()
    setup = lm_setup(target, model, batch_per_device)
    lower = lower_with(setup)
    plain, _ = compile_program("plain step", lower(None))
    log(f"plain step compiled in {plain.compile_s:.1f} s")
    reference, _ = compile_program("user step", lower_reference(setup))
    flops_hint = setup.train_flops() / len(target.devices)
    first_plan = plan_window(setup, 1)
    probe = WindowReport(target, first_plan, plain, (), reference)
    cost = predict.step_cost(probe, flops_hint)
    labels: dict[int, str] = {}
    if ks is None:
        labels[1] = "1"
        for n in intervals:
            labels.setdefault(predict.auto_k(probe, cost, n), f"auto at N={n}")
        labels.setdefault(best_k(probe, cost), "best")
    else:
        labels = {k: "given" for k in ks}
    windows = {}
    for k in sorted(labels):
        plan = first_plan if k == 1 else plan_window(setup, k)
        windows[plan.k] = WindowReport(target, plan, plain, compile_phases(lower, plan), reference)
        labels.setdefault(plan.k, labels[k])
        log(f"K={plan.k}: {plan.k} phases compiled")
    notes = [f"model {model}: {setup.config.num_params() / 1e6:.0f}M parameters, bf16 compute, f32 params and "
             f"Adam moments (mixed precision), batch {setup.batch_size} x {setup.config.seq_len} tokens, "
             f"FSDP over {len(target.devices)} device(s)",
             f"flops per device: {flops_hint:.3g} by the 6N-per-token estimate, "
             f"{plain.flops:.3g} by the compiler's cost analysis" if plain.flops else
             f"flops per device: {flops_hint:.3g} by the 6N-per-token estimate (no cost analysis from this compiler)",
             f"everything compiled on this machine from abstract inputs in {time.perf_counter() - started:.0f} s"]
    text = markdown(model, windows, labels, cost, list(intervals), notes)
    if measure:
        text += "\n" + calibrate(setup, probe, cost).markdown()
    return text, windows
