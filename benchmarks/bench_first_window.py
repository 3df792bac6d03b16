"""A new user's loop that never syncs, measured as issue 58 measured it: where the first
window's cost goes.

    python -m benchmarks.bench_first_window --model 20m --batch-size 2 --interval 50 --rounds 3 \
        --out benchmarks/results/cpu_20m_first_window

Why a benchmark of its own: ``benchmarks.bench_interval`` warms every loop up with an
unmeasured block that holds a checkpoint, so what a run pays once (compiling the window
variants of the step) never reaches its measured blocks. A user's short run, or the first
minutes of a long one, pays it. Issue 58 measured such a loop (a 20M Linen LM,
``optax.chain(clip_by_global_norm, adamw)`` with a warmup-cosine schedule, ``window="auto"``,
no ``block_until_ready`` and no loss read inside 100 measured steps after a short warm-up)
and found overlap_ckpt behind Orbax async at a checkpoint every 50 steps.

Each loop runs in a fresh process (a variant compiled by an earlier loop would be in the
process's caches): ``--warmup`` steps (the plain step compiles; no checkpoint falls in them),
then 100 steps dispatched with no sync, timed to the fetch of the last loss. Loops:

* ``none``: no checkpointing (the reference of the ratio);
* ``orbax async``: ``ocp.CheckpointManager`` (async), ``save`` at every ``--interval``-th step;
* ``overlap``: ``CheckpointManager(window="auto")``, ``mngr.step`` every step, as the README's
  loop without ``compile_ahead``;
* ``overlap + compile_ahead``: the same with ``mngr.compile_ahead(train_step, state, batch)``.

Per loop and round: the span's seconds, the XLA compile seconds on the training thread inside
the span (jax's compile event, recorded by the worker itself), the checkpoints committed
in the span, and the span's CPU seconds by thread group (``benchmarks.thread_cpu``; in the
table: the checkpointers' own threads, everything but the training thread, XLA's compute
pool and unnamed Python threads). Rounds interleave the loops (``none`` first), so drift between rounds hits all;
per round, each loop's span is compared with the ``none`` span of the same round.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import threading
import time

from benchmarks import thread_cpu
from benchmarks.harness import run_fresh
from benchmarks.reporting import publish

LOOPS = ("none", "orbax async", "overlap", "overlap + compile_ahead")
SPAN = 100


def worker(args: argparse.Namespace) -> dict:
    import jax
    import optax

    from benchmarks.lm_loop import lm_loop, orbax_async_manager, orbax_save

    compiles: list[tuple[float, float]] = []  # (end time, seconds) of each compile on this thread
    main = threading.current_thread()

    def listener(event: str, duration_secs: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and threading.current_thread() is main:
            compiles.append((time.perf_counter(), duration_secs))
    jax.monitoring.register_event_duration_secs_listener(listener)

    lm = lm_loop(args.model, args.batch_size)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 10_000)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    state = lm.fresh_state(tx=tx)
    directory = tempfile.mkdtemp(prefix="bench_first_window_")
    mngr = omngr = None
    if args.loop.startswith("overlap"):
        import overlap_ckpt as oc
        mngr = oc.CheckpointManager(directory, save_interval_steps=args.interval, window="auto", max_to_keep=2)
        state = mngr.prepare(state)
        if args.loop == "overlap + compile_ahead":
            mngr.compile_ahead(lm.train_step, state, lm.batches[0])
    elif args.loop == "orbax async":
        omngr = orbax_async_manager(directory, args.interval)

    saved = []  # steps Orbax started a save of

    def run(first: int, steps: int):
        nonlocal state
        loss = None
        for t in range(first, first + steps):
            state, loss = lm.train_step(state, lm.batches[t % len(lm.batches)])
            if mngr is not None:
                state = mngr.step(state)
            elif omngr is not None and (t + 1) % args.interval == 0 and orbax_save(omngr, t + 1, state):
                saved.append(t + 1)
        return loss

    float(run(0, args.warmup))
    threads_before, usage_before = thread_cpu.read(), resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    float(run(args.warmup, SPAN))
    end = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    by_thread = thread_cpu.with_ended(thread_cpu.by_group(threads_before, thread_cpu.read()),
                                      usage.ru_utime + usage.ru_stime - usage_before.ru_utime - usage_before.ru_stime)
    in_span = [s for at, s in compiles if start <= at <= end]
    if mngr is not None:
        mngr.wait_until_finished()
        saved = [record.step for record in mngr.store.history]
        mngr.close()
    elif omngr is not None:
        omngr.wait_until_finished()
        omngr.close()
    committed = sum(args.warmup < step <= args.warmup + SPAN for step in saved)
    return {"span_s": end - start, "compile_s": sum(in_span), "compiles": len(in_span), "committed": committed,
            "thread_cpu_s": by_thread}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="20m")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--interval", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=20, help="steps before the span (< --interval)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", dest="loop", choices=LOOPS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loop is not None:
        print(json.dumps(worker(args)))
        return {}
    if not 0 < args.warmup < args.interval:
        ap.error("--warmup must be between 0 and --interval: no checkpoint may fall in it")
    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--interval", str(args.interval),
              "--warmup", str(args.warmup)]
    rows: dict[str, list[dict]] = {loop: [] for loop in LOOPS}
    for r in range(args.rounds):
        for loop in LOOPS:
            rows[loop].append({"round": r, **run_fresh("benchmarks.bench_first_window", [*common, "--worker", loop],
                                                       label=loop)})
            print(f"round {r} {loop}: {rows[loop][-1]}", file=sys.stderr, flush=True)
    report = {"benchmark": "bench_first_window", "model": args.model, "batch_size": args.batch_size,
              "interval": args.interval, "warmup": args.warmup, "span": SPAN, "rounds": args.rounds,
              "rows": rows, "summary": summarize(rows)}
    publish(report, markdown(report), args.out)
    return report


def summarize(rows: dict[str, list[dict]]) -> dict:
    """Per loop: median span, its ratio to ``none``'s span of the same round (ETTR = none /
    loop) and its excess over it, round by round, and the compile seconds in the span."""
    none = [row["span_s"] for row in rows["none"]]
    summary = {}
    for loop, loop_rows in rows.items():
        excess = [row["span_s"] - ref for row, ref in zip(loop_rows, none)]
        summary[loop] = {"span_s": statistics.median(row["span_s"] for row in loop_rows),
                         "ettr_by_round": [ref / row["span_s"] for row, ref in zip(loop_rows, none)],
                         "excess_by_round_s": excess,
                         "compile_s_by_round": [row["compile_s"] for row in loop_rows],
                         "committed": [row["committed"] for row in loop_rows],
                         "checkpointer_cpu_s_by_round": [checkpointer_cpu_s(row) for row in loop_rows]}
    return summary


NOT_CHECKPOINTER = ("training", "xla compute", "other python", "pjrt")


def checkpointer_cpu_s(row: dict) -> float:
    """CPU seconds of the checkpointer's own threads in the span (a run without the column: 0)."""
    return sum(s for group, s in row.get("thread_cpu_s", {}).items() if group not in NOT_CHECKPOINTER)


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [f"# A new user's loop that never syncs, first windows included: {report['model']}, "
             f"checkpoint every {report['interval']} steps, {report['rounds']} rounds", "",
             f"Command: `python -m benchmarks.bench_first_window --model {report['model']} --batch-size "
             f"{report['batch_size']} --interval {report['interval']} --rounds {report['rounds']}`", "",
             f"Each loop in a fresh process: {report['warmup']} warm-up steps, then {report['span']} steps "
             "dispatched with no sync, timed to the last loss; rounds interleave the loops.", "",
             "| loop | span s (median) | ETTR by round (none / loop) | excess over none by round, s | "
             "compile on the training thread in the span by round, s | checkpoints committed in the span | "
             "checkpointer threads' CPU in the span by round, s |",
             "|---|--:|---|---|---|---|---|"]
    for loop in LOOPS:
        row = s[loop]
        lines.append(f"| {loop} | {row['span_s']:.2f} | {', '.join(f'{x:.3f}' for x in row['ettr_by_round'])} | "
                     f"{', '.join(f'{x:+.2f}' for x in row['excess_by_round_s'])} | "
                     f"{', '.join(f'{x:.2f}' for x in row['compile_s_by_round'])} | "
                     f"{', '.join(str(x) for x in row['committed'])} | "
                     f"{', '.join(f'{x:.2f}' for x in row['checkpointer_cpu_s_by_round'])} |")
    orbax = s["orbax async"]["excess_by_round_s"]
    for loop in ("overlap", "overlap + compile_ahead"):
        diff = [a - b for a, b in zip(s[loop]["excess_by_round_s"], orbax)]
        lines += ["", f"{loop} against Orbax async, round by round (its excess minus Orbax's, s): "
                  + ", ".join(f"{x:+.2f}" for x in diff)
                  + f"; behind in {sum(x > 0 for x in diff)} of {len(diff)} rounds"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
