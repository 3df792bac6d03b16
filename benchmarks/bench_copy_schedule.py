"""Where XLA:GPU starts a window's host copy within the step, and what starting it at the top
would save: each window phase compiled as XLA schedules it, and again with a latency hint.

    # compile-only, no GPU needed (the CUDA plugin of the extra "aot-gpu", JAX_PLATFORMS=cpu)
    python -m benchmarks.bench_copy_schedule --target h100 --model 100m --k 1 3
    # on one GPU: also each program timed, alternating with the plain step
    python -m benchmarks.bench_copy_schedule --target gpu --model 1b --batch-per-device 16 --k 1 3 \
        --out benchmarks/results/gpu_h200_1b_copy_schedule

Why: on an H200 the 1B LM's window copies hid under only 0.14-0.34 of the step
(``results/aot_gpu_h200_1b.md``), and a profiler trace showed why: the copy runs at the
link's speed but starts about 0.7 of the way through the step, after the backward pass,
although it reads the step's inputs. XLA:GPU's scheduler places it by its own estimate of
the copy's latency against the compute around it. The hint is a profile-guided latency
estimation (PGLE) profile that gives each host ``copy-start`` a cost ``--hint-factor``
times its bytes at ``--link-gbps``; the scheduler then starts it where its input is ready
(the top of the program for the state, the end of the backward pass for gradients). The
price is device memory: the packed outbox lives through the whole step.

This is a measurement, not a feature: a user's jit does not take this hint from overlap_ckpt
(see the report for what it would take).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax

from benchmarks.reporting import publish

MIB = 2**20


def host_copy_positions(hlo_text: str) -> list[dict]:
    """Each host copy of a compiled program: its instruction, bytes, and the compute ops
    scheduled before it and between its start and done, of the program's total."""
    from overlap_ckpt.aot import hlo

    instructions = hlo.entry_instructions(hlo_text)
    total = sum(i.opcode in hlo.COMPUTE_OPCODES for i in instructions)
    return [{"start": c.name, "bytes": c.nbytes, "compute_before": c.compute_before,
             "compute_between": c.compute_between, "compute_total": total} for c in hlo.host_copies(instructions)]


def latency_hint(copies: list[dict], link_gbps: float, factor: float, directory: str) -> str:
    """A PGLE profile (text ``ProfiledInstructionsProto``) costing each host copy-start
    ``factor`` x its bytes at ``link_gbps``; returns its path."""
    from overlap_ckpt.manager.copy_schedule import write_profile

    path = os.path.join(directory, "copy_latency_hint.pbtxt")
    write_profile(path, {c["start"]: c["bytes"] / (link_gbps * 1e3) * factor for c in copies})
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100",
                    help="h100 (compile-only), or this machine's devices, timed: gpu, or cpu (a smoke run)")
    ap.add_argument("--model", default="100m")
    ap.add_argument("--batch-per-device", type=int, default=16)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--phases", choices=("last", "all"), default="last",
                    help="the last phase of each K (no gradients: the largest copy) or every phase")
    ap.add_argument("--link-gbps", type=float, default=52.0, help="the host link the hint assumes (H200: 52)")
    ap.add_argument("--hint-factor", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds, alternating default and hinted")
    ap.add_argument("--out")
    args = ap.parse_args()

    jax.config.update("jax_enable_compilation_cache", False)  # compile here, to read the schedule
    from overlap_ckpt.aot import device_check, get_target, lm_step
    from overlap_ckpt.core.ticket import WindowTicket

    started = time.perf_counter()

    def note(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {line}", flush=True)

    target = get_target(args.target)
    timed = args.target in ("gpu", "cpu")
    setup = lm_step.lm_setup(target, args.model, args.batch_per_device)
    lower = lm_step.lower_with(setup)
    plain = lower(None).compile()
    note("plain step compiled")
    state = None
    plain_s = []
    if timed:
        state = device_check.ChainedState(*(device_check.filled_like(x, seed) for seed, x in enumerate(
            (setup.params, setup.opt_state, setup.batch, setup.step))))
        plain_s.append(device_check.time_calls(plain, state))
        note(f"plain step {plain_s[-1]:.4f} s")
    hints = tempfile.mkdtemp(prefix="copy-schedule-")
    rows = []
    for k in args.k:
        plan = lm_step.plan_window(setup, k)
        for j in (range(k) if args.phases == "all" else [k - 1]):
            lowered = lower(WindowTicket(plan, j))
            default = lowered.compile()
            copies = host_copy_positions(default.as_text())
            path = latency_hint(copies, args.link_gbps, args.hint_factor, tempfile.mkdtemp(dir=hints))
            hinted = lowered.compile(compiler_options={"xla_gpu_pgle_profile_file_or_directory_path": path})
            row = {"k": k, "phase": j}
            for name, program in (("default", default), ("hinted", hinted)):
                row[name] = {"copies": host_copy_positions(program.as_text()),
                             "temp_bytes": program.memory_analysis().temp_size_in_bytes, "step_s": []}
            note(f"K={k} phase {j} compiled: " + "; ".join(
                f"{name} {_where(row[name]['copies'])}" for name in ("default", "hinted")))
            for _ in range(args.rounds if timed else 0):
                for name, program in (("default", default), ("hinted", hinted)):
                    row[name]["step_s"].append(device_check.time_calls(program, state))
                    note(f"K={k} phase {j} {name}: {row[name]['step_s'][-1]:.4f} s")
            if timed:
                plain_s.append(device_check.time_calls(plain, state))
                note(f"plain step {plain_s[-1]:.4f} s")
            rows.append(row)
    device = str(target.devices[0].device_kind) if timed else args.target
    report = {"benchmark": "bench_copy_schedule", "model": args.model, "batch_per_device": args.batch_per_device,
              "device": device, "link_gbps": args.link_gbps, "hint_factor": args.hint_factor,
              "plain_step_s": plain_s, "rows": rows, "jax": jax.__version__}
    publish(report, markdown(report), args.out)


def _where(copies: list[dict]) -> str:
    return ", ".join(f"{c['bytes'] / MIB:.0f} MiB after {c['compute_before']}/{c['compute_total']} ops "
                     f"({c['compute_between']} between)" for c in copies)


def markdown(report: dict) -> str:
    plain = report["plain_step_s"]
    lines = [f"# Where XLA:GPU starts a window's host copy: {report['model']} on {report['device']}", "",
             f"Batch {report['batch_per_device']} per device; jax {report['jax']}; hint: each host copy-start "
             f"costed {report['hint_factor']:g}x its bytes at {report['link_gbps']:g} GB/s (a PGLE profile).", ""]
    if plain:
        lines += [f"Plain step: {', '.join(f'{s:.4f}' for s in plain)} s (timed before, between and after the "
                  "window programs).", ""]
    lines += ["| K | phase | schedule | host copies: MiB, compute ops before the start / total (between start and done) "
              "| device temporaries MiB | step s | stall s vs the plain steps |",
              "|--:|--:|---|---|--:|---|---|"]
    for row in report["rows"]:
        for name in ("default", "hinted"):
            r = row[name]
            steps = r["step_s"]
            stall = (f"{min(steps) - max(plain):.3f} to {max(steps) - min(plain):.3f}" if steps and plain else "-")
            lines.append(f"| {row['k']} | {row['phase']} | {name} | {_where(r['copies'])} | "
                         f"{r['temp_bytes'] / MIB:.0f} | {', '.join(f'{s:.4f}' for s in steps) or '-'} | {stall} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
