"""The per-step cost of overlap_ckpt outside checkpoint windows, measured in one process.

    python -m benchmarks.bench_tax --model 20m --batch-size 2 --rounds 10 --out benchmarks/results/cpu_20m_tax

Separate processes (``benchmarks.run``) cannot resolve a 1% difference on a shared machine:
the same program measured in two runs differs by several percent. Here three loops share one
process, one jitted step and the same batches, and take turns, a few steps each, in an order
rotated every round:

* ``plain``: ``overlap_ckpt.TrainState`` never given to a manager (Flax's program);
* ``idle``: a ``CheckpointManager`` whose interval is never reached, ``mngr.step`` every step;
* ``windows``: a ``CheckpointManager`` with K=1 windows every ``--interval`` steps; only its
  steps outside windows with no checkpoint work in flight are in the table. Window steps, the
  steps right after them, and any step that starts or ends while a copy is still being
  replayed or persisted share the cores with that background work: they are the
  checkpoint's cost (in ``benchmarks.run``'s ETTR), not the per-step tax, and are reported
  apart. On a slow day a persist outlasts the step after its window, and counting the steps
  it overlaps as "outside windows" measured the persist, not the manager.

Reported: medians and the median of per-round ratios to ``plain`` (paired), and the time
the training thread spends in ``mngr.step`` itself on the table's steps (what the manager
adds to a step, measured directly: the paired ratio also carries whatever else moved between
the loops' turns), as JSON and a Markdown table. Every step ends with
``jax.block_until_ready`` (the same sync in every loop).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks.lm_loop import lm_loop
from benchmarks.reporting import publish


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "small", "20m", "100m"))
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps-per-turn", type=int, default=4)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--out", default=None, help="output prefix: <out>.json and <out>.md")
    args = ap.parse_args(argv)

    import jax
    import optax

    import overlap_ckpt as oc

    lm = lm_loop(args.model, args.batch_size)
    batches, train_step = lm.batches, lm.train_step

    def fresh():  # each loop its own optimizer object (LMLoop.fresh_state)
        return lm.fresh_state(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01)))

    root = tempfile.mkdtemp(prefix="bench_tax_")
    idle = oc.CheckpointManager(os.path.join(root, "idle"), save_interval_steps=10**9, window=1)
    windows = oc.CheckpointManager(os.path.join(root, "windows"), save_interval_steps=args.interval, window=1)
    loops = {"plain": [fresh(), None], "idle": [idle.prepare(fresh()), idle],
             "windows": [windows.prepare(fresh()), windows]}
    windows.compile_ahead(train_step, loops["windows"][0], batches[0])
    times: dict[str, list[float]] = {name: [] for name in loops}
    near_window: list[float] = []
    per_round: dict[str, list[float]] = {name: [] for name in loops}
    counters = {name: 0 for name in loops}
    calls: dict[str, list[float]] = {name: [] for name in loops}  # seconds in mngr.step, table steps

    def in_flight(mngr) -> bool:
        """Whether a checkpoint is still being replayed or persisted in the background."""
        return mngr is not None and bool(mngr.engine.held_bytes() or mngr.store.pending_steps())

    def run(name: str, steps: int, record: bool) -> list[float]:
        state, mngr = loops[name]
        out = []
        for _ in range(steps):
            t = counters[name]
            window = mngr is not None and mngr.engine.schedule.target(t) is not None
            after = mngr is not None and mngr.engine.schedule.target(t - 1) is not None
            busy = in_flight(mngr)
            start = time.perf_counter()
            state, loss = train_step(state, batches[t % len(batches)])
            call = 0.0
            if mngr is not None:
                before_call = time.perf_counter()
                state = mngr.step(state)
                call = time.perf_counter() - before_call
            jax.block_until_ready((state.params, loss))
            dt = time.perf_counter() - start
            busy = busy or in_flight(mngr)
            counters[name] = t + 1
            if record and not (name == "windows" and (window or after or busy)):
                out.append(dt)
                if mngr is not None:
                    calls[name].append(call)
            elif record:
                near_window.append(dt)
        loops[name][0] = state
        return out

    names = list(loops)
    for name in names:  # compile and warm up (the windows loop through one window)
        run(name, args.interval + 2, record=False)
    windows.wait_until_finished()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            got = run(name, args.steps_per_turn, record=True)
            times[name] += got
            if got:
                per_round[name].append(statistics.median(got))
    idle.close()
    windows.close()

    def paired(name: str) -> float:
        pairs = [b / a for a, b in zip(per_round["plain"], per_round[name])]
        return statistics.median(pairs)

    report = {
        "benchmark": "bench_tax", "model": args.model, "batch_size": args.batch_size,
        "rounds": args.rounds, "steps_per_turn": args.steps_per_turn, "interval": args.interval,
        "optimizer": "clip_by_global_norm + adamw", "device": str(lm.device),
        "loadavg_at_end": list(os.getloadavg()),
        "median_step_s": {name: statistics.median(v) for name, v in times.items() if v},
        "paired_ratio_to_plain": {name: paired(name) for name in ("idle", "windows")},
        "min_step_s": {name: min(v) for name, v in times.items() if v},
        "mngr_step_s": {name: {"median": statistics.median(v), "max": max(v)} for name, v in calls.items() if v},
        "steps_measured": {name: len(v) for name, v in times.items()},
        "window_and_next_step_median_s": statistics.median(near_window) if near_window else None,
    }
    lines = [f"# Per-step cost outside windows: {args.model}, one process, {args.rounds} interleaved rounds", "",
             "| loop | median step ms | min ms | paired ratio to plain | `mngr.step` ms, median / max | steps |",
             "|---|--:|--:|--:|--:|--:|"]
    for name in names:
        ratio = "1" if name == "plain" else f"{report['paired_ratio_to_plain'][name]:.4f}"
        call = report["mngr_step_s"].get(name)
        call_ms = "-" if call is None else f"{call['median'] * 1e3:.3f} / {call['max'] * 1e3:.3f}"
        lines.append(f"| {name} | {report['median_step_s'][name] * 1e3:.1f} | {report['min_step_s'][name] * 1e3:.1f} "
                     f"| {ratio} | {call_ms} | {report['steps_measured'][name]} |")
    if near_window:
        lines += ["", f"Steps of the `windows` loop beside a checkpoint (its window step, the step after, and "
                      f"steps that start or end while its copy is replayed or persisted): median "
                      f"{report['window_and_next_step_median_s'] * 1e3:.1f} ms over {len(near_window)} steps "
                      "(not in the table)."]
    publish(report, "\n".join(lines) + "\n", args.out)
    return report


if __name__ == "__main__":
    main()
