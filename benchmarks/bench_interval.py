"""Cost per checkpoint at a short and a long interval, measured in one process.

    python -m benchmarks.bench_interval --model 20m --batch-size 2 --rounds 4 --sync-every 5 \
        --out benchmarks/results/cpu_20m_interval

Why another benchmark: ``benchmarks.run`` gives each configuration its own process and
reads the cost per checkpoint over the whole measured span, against the no-checkpoint
process's mean step. At a checkpoint every 50 steps one checkpoint shares its span with 50
steps, so a 1% drift of the step time between two processes (measured: 2% on this 2-core
machine) reads as ~190 ms per checkpoint, and the N=50 figure cannot be told apart from
drift. Here every loop shares one process, one jitted step and the same batches, and the
loops take turns, one block of ``--block`` steps each, in an order rotated every round:

* ``plain``: no checkpointing (the paired reference of every block);
* ``overlap N=n``: ``overlap_ckpt.CheckpointManager(window=--window)``, ``mngr.step`` every step;
* ``orbax async N=n``: ``ocp.CheckpointManager`` (async), ``save`` when ``(t+1) % n == 0``;

for each ``n`` in ``--intervals`` (``--block`` must be a multiple of each). A block starts half
an interval of the longest ``n`` off its checkpoints, so the long interval's checkpoint falls
in the middle of a block, with training steps after it, as at the short interval. A block is
timed to the fetch of its last loss, then the checkpointer is drained (``wait_until_finished``,
timed apart), so no block's background work spills into another loop's block.

Reported per loop, median over rounds of the paired difference to the ``plain`` block of the
same round, divided by the checkpoints in the block: the cost per checkpoint on the training
thread (block only) and in total (block + drain: everything a checkpoint costs this host,
including the background persist that on 2 cores competes with training). The loop syncs
every ``--sync-every`` steps (1: every step, as ``benchmarks.run``; 5: the loss is fetched
every 5 steps, as most real loops do).

What it cannot resolve yet (benchmarks/results/cpu_20m_interval.md): the loops are separate
states and programs in one process, and on the 20M LM their blocks differ by more than a
checkpoint's cost even without one (the overlap N=50 loop's blocks ran 1.4 s faster than
the plain loop's, with one checkpoint in each), so at N=50 the paired difference is that
offset, not the checkpoint. The process's minor page faults per checkpoint do hold up.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time

from benchmarks.lm_loop import lm_loop
from benchmarks.reporting import publish


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "small", "20m", "100m"))
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--intervals", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--block", type=int, default=None, help="steps per turn (default: the longest interval)")
    ap.add_argument("--window", default="1", help="overlap K: an integer or 'auto'")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--no-orbax", action="store_true", help="leave out the Orbax async loops")
    ap.add_argument("--out", default=None, help="output prefix: <out>.json and <out>.md")
    args = ap.parse_args(argv)
    block = args.block or max(args.intervals)
    if any(block % n for n in args.intervals):
        ap.error(f"--block {block} must be a multiple of every interval {args.intervals}")
    window = args.window if args.window == "auto" else int(args.window)

    import jax
    import optax
    import orbax.checkpoint as ocp

    import overlap_ckpt as oc
    from overlap_ckpt.tools.models import linen_init

    lm = lm_loop(args.model, args.batch_size)
    config, model, device, batches, train_step = lm.config, lm.model, lm.device, lm.batches, lm.train_step

    # Every loop starts half the longest interval off a checkpoint: its blocks then hold the
    # long interval's checkpoint in their middle.
    start_step = max(args.intervals) // 2

    def fresh():
        # Each loop its own optimizer object: a window ticket on this thread applies to every
        # update with the transformation it was planned for (overlap_ckpt.core.window_context).
        tx = optax.adamw(1e-3, weight_decay=0.01)
        state = oc.TrainState.create(apply_fn=model.apply, params=linen_init(config, 0), tx=tx)
        return jax.device_put(state.replace(step=jax.numpy.int32(start_step)), device)

    root = tempfile.mkdtemp(prefix="bench_interval_")
    loops: dict[str, dict] = {"plain": {"state": fresh(), "n": None}}
    for n in args.intervals:
        mngr = oc.CheckpointManager(os.path.join(root, f"overlap_{n}"), save_interval_steps=n, window=window)
        state = mngr.prepare(fresh())
        mngr.compile_ahead(train_step, state, batches[0])
        loops[f"overlap N={n}"] = {"state": state, "n": n, "mngr": mngr}
        if not args.no_orbax:
            omngr = ocp.CheckpointManager(os.path.join(root, f"orbax_{n}"), options=ocp.CheckpointManagerOptions(
                save_interval_steps=n, max_to_keep=2, enable_async_checkpointing=True))
            loops[f"orbax async N={n}"] = {"state": fresh(), "n": n, "omngr": omngr}
    for loop in loops.values():
        loop["t"] = start_step

    def drain(loop: dict) -> None:
        if "mngr" in loop:
            loop["mngr"].wait_until_finished()
        elif "omngr" in loop:
            loop["omngr"].wait_until_finished()

    def run_block(loop: dict) -> dict:
        """The block's seconds, its drain's seconds, the checkpoints it committed, and the
        process's CPU seconds and minor page faults over block and drain (both hardly move
        with the machine's load, where wall time does; a checkpoint that writes into memory
        given back to the OS since the last one faults every page again)."""
        state, n, first = loop["state"], loop["n"], loop["t"]
        mngr, omngr = loop.get("mngr"), loop.get("omngr")
        before = resource.getrusage(resource.RUSAGE_SELF)
        persisted = len(mngr.store.history) if mngr is not None else 0
        saved = 0
        start = time.perf_counter()
        for t in range(first, first + block):
            state, loss = train_step(state, batches[t % len(batches)])
            if mngr is not None:
                state = mngr.step(state)
            elif omngr is not None and (t + 1) % n == 0:
                saved += bool(omngr.save(t + 1, args=ocp.args.StandardSave(
                    {"params": state.params, "opt_state": state.opt_state})))
            if (t + 1 - first) % args.sync_every == 0 or t == first + block - 1:
                float(loss)
        end = time.perf_counter()
        drain(loop)
        drained = time.perf_counter()
        loop["state"], loop["t"] = state, first + block
        if mngr is not None:
            saved = len(mngr.store.history) - persisted
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {"block_s": end - start, "drain_s": drained - end, "ckpts": saved,
                "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                "minor_faults": after.ru_minflt - before.ru_minflt}

    names = list(loops)
    for name in names:  # compile, warm up and take one checkpoint of each kind, unmeasured
        run_block(loops[name])
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rows[name].append({"round": r, **run_block(loops[name])})
    for loop in loops.values():
        for key in ("mngr", "omngr"):
            if key in loop:
                loop[key].close()
    shutil.rmtree(root, ignore_errors=True)

    def per_ckpt(name: str, total: bool) -> float:
        """Median over rounds of (this block [+ drain] - the plain block) / checkpoints."""
        diffs = []
        for mine, plain in zip(rows[name], rows["plain"]):
            extra = mine["block_s"] + (mine["drain_s"] if total else 0.0) - plain["block_s"]
            diffs.append(extra / mine["ckpts"])
        return statistics.median(diffs)

    def extra_per_ckpt(name: str, key: str) -> float:
        """Median over rounds of (this block's ``key`` - the plain block's) / checkpoints."""
        return statistics.median((mine[key] - plain[key]) / mine["ckpts"]
                                 for mine, plain in zip(rows[name], rows["plain"]))

    summary = {name: {"n": loops[name]["n"],
                      "block_s_median": statistics.median(row["block_s"] for row in rows[name]),
                      "drain_s_median": statistics.median(row["drain_s"] for row in rows[name]),
                      "per_ckpt_training_s": per_ckpt(name, total=False) if loops[name]["n"] else None,
                      "per_ckpt_total_s": per_ckpt(name, total=True) if loops[name]["n"] else None,
                      "cpu_s_per_ckpt": extra_per_ckpt(name, "cpu_s") if loops[name]["n"] else None,
                      "minor_faults_per_ckpt": extra_per_ckpt(name, "minor_faults") if loops[name]["n"] else None}
               for name in names}
    report = {"benchmark": "bench_interval", "model": args.model, "batch_size": args.batch_size,
              "intervals": args.intervals, "block": block, "window": args.window, "rounds": args.rounds,
              "sync_every": args.sync_every, "device": str(device), "loadavg_at_end": list(os.getloadavg()),
              "rows": rows, "summary": summary}
    publish(report, markdown(report), args.out)
    return report


def markdown(report: dict) -> str:
    summary = report["summary"]
    lines = [f"# Cost per checkpoint by interval: {report['model']}, one process, {report['rounds']} rounds",
             "",
             f"Blocks of {report['block']} steps per turn; loss fetched every {report['sync_every']} steps; "
             f"overlap window {report['window']}; load average at the end {report['loadavg_at_end'][0]:.1f}.",
             "",
             "| loop | N | block s (median) | drain s (median) | per checkpoint, training thread ms | "
             "per checkpoint, total ms | x Orbax async (total) | CPU s per checkpoint | "
             "minor faults per checkpoint (MiB of 4 KiB pages) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, s in summary.items():
        n = s["n"]
        orbax = summary.get(f"orbax async N={n}")
        ratio = (f"{s['per_ckpt_total_s'] / orbax['per_ckpt_total_s']:.2f}"
                 if n and orbax and orbax["per_ckpt_total_s"] > 0 else "-")
        per = (lambda v: "-" if v is None else f"{v * 1e3:.0f}")
        faults = "-" if not n else f"{s['minor_faults_per_ckpt']:.0f} ({s['minor_faults_per_ckpt'] * 4096 / 2**20:.0f})"
        lines.append(f"| {name} | {n or '-'} | {s['block_s_median']:.2f} | {s['drain_s_median']:.2f} | "
                     f"{per(s['per_ckpt_training_s'])} | {per(s['per_ckpt_total_s'])} | {ratio} | "
                     f"{'-' if not n else format(s['cpu_s_per_ckpt'], '.2f')} | {faults} |")
    for kind in ("overlap", "orbax async"):
        costs = {s["n"]: s["per_ckpt_total_s"] for name, s in summary.items() if name.startswith(kind)}
        if len(costs) >= 2:
            short, long_ = min(costs), max(costs)
            lines.append("")
            lines.append(f"{kind}: total cost per checkpoint at N={long_} is "
                         f"{costs[long_] / costs[short]:.2f}x the one at N={short} (target for overlap: <= 1.2x)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
