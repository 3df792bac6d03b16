"""Cost per checkpoint at a short and a long interval, measured in one process.

    python -m benchmarks.bench_interval --model 20m --batch-size 2 --rounds 4 --sync-every 5 \
        --out benchmarks/results/cpu_20m_interval

Why another benchmark: ``benchmarks.run`` gives each configuration its own process and
reads the cost per checkpoint over the whole measured span, against the no-checkpoint
process's mean step. At a checkpoint every 50 steps one checkpoint shares its span with 50
steps, so a 1% drift of the step time between two processes (measured: 2% on this 2-core
machine) reads as ~190 ms per checkpoint, and the N=50 figure cannot be told apart from
drift. Separate loops in one process do not settle it either: two states and programs of
the same model differed by 1.4 s per 50-step block with no checkpoint between them (an
earlier version of this benchmark, benchmarks/results/cpu_20m_interval_loops.md).

Here each strategy is one loop (one state, one jitted step, one checkpointer), for each
``n`` in ``--intervals``:

* ``overlap N=n``: ``overlap_ckpt.CheckpointManager(window=--window)``, ``mngr.step`` every step;
* ``overlap, no checksums N=n`` (``--checksums both|off``): the same with
  ``CheckpointStore(checksums=False)``, whose chunks carry no crc32c, as Orbax's data chunks
  carry none (it checksums only the shard index): the two then do the same integrity work;
* ``orbax async N=n``: ``ocp.CheckpointManager`` (async), ``save`` when ``(t+1) % n == 0``;

and its blocks of ``--block`` steps (a multiple of every ``n``) alternate between
checkpointing *on* and *off*, on-off in even rounds and off-on in odd ones. Off, Orbax is not
asked to save and overlap_ckpt skips the block's windows (``WindowTracker.skip``: the
window steps run their no-copy variant, as when the host budget skips a checkpoint), so the
difference is the checkpoint itself: copies, replay, persist. A block starts half an
interval of the longest ``n`` off its checkpoints, so the long interval's checkpoint falls
in its middle, with training steps after it. A block is timed to the fetch of its last
loss, then the checkpointer is drained (``wait_until_finished``, timed apart), so no
block's background work spills into the next.

Reported per loop, median over rounds of (on - off) / checkpoints in the on block: the cost
per checkpoint on the training thread (block only) and in total (block + drain: everything
a checkpoint costs this host, including the background persist that on 2 cores competes
with training), the process's CPU seconds and minor page faults per checkpoint (both hardly
move with the machine's load, where wall time does), and the same from the loss-fetch
segments: what the segments holding a checkpoint add to the off block's median segment, and
what all other segments add (``per_ckpt_segments``; at N=50 the whole-block difference is
dominated by drift, benchmarks/results/cpu_20m_interval_n50_12rounds.md). Where a block
holds one checkpoint in its middle, what the segments after it add against the segments
before it in the same block (``spill_after_by_round_s``: the drift of the whole block
cancels, as it does not in "other segments"). Against Orbax,
each overlap loop is also compared round by round (``orbax_minus_this_by_round_s``): the
loops of one round run within minutes of each other, so the drift between rounds cancels.
The loop fetches its loss every ``--sync-every`` steps (1: every step, as
``benchmarks.run``; 5, as many real loops do; 0: never inside a block, as a loop that only
dispatches steps and logs asynchronously, where the runtime may run many steps ahead of
Python). Where the cost goes, per checkpoint: the training thread's wall time in the
jitted step's call, in the checkpointer's per-step call and at loss fetches, and the
process's CPU seconds by thread group (``benchmarks.thread_cpu``: training, XLA's compute
pool, overlap_ckpt's replay and persist threads, tensorstore, Orbax's threads).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time

from benchmarks import thread_cpu
from benchmarks.lm_loop import lm_loop, orbax_async_manager, orbax_save
from benchmarks.reporting import publish


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "small", "20m", "100m"))
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--intervals", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--block", type=int, default=None, help="steps per turn (default: the longest interval)")
    ap.add_argument("--window", default="1", help="overlap K: an integer or 'auto'")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=5,
                    help="fetch the loss every this many steps; 0: never inside a block (a loop that never "
                         "syncs), only its last step's, which ends the block's timing")
    ap.add_argument("--checksums", default="on", choices=("on", "off", "both"),
                    help="overlap loops whose chunks carry a crc32c (on: the default store), none, or one of each")
    ap.add_argument("--no-orbax", action="store_true", help="leave out the Orbax async loops")
    ap.add_argument("--out", default=None, help="output prefix: <out>.json and <out>.md")
    ap.add_argument("--summarize", metavar="JSON", default=None,
                    help="run nothing: recompute the summary and table of an earlier run's JSON (to --out)")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            report = json.load(f)
        report["summary"] = summarize(report)
        publish(report, markdown(report), args.out)
        return report
    block = args.block or max(args.intervals)
    if any(block % n for n in args.intervals):
        ap.error(f"--block {block} must be a multiple of every interval {args.intervals}")
    window = args.window if args.window == "auto" else int(args.window)

    import overlap_ckpt as oc

    lm = lm_loop(args.model, args.batch_size)
    batches, train_step = lm.batches, lm.train_step

    # Every loop starts half the longest interval off a checkpoint: its blocks then hold the
    # long interval's checkpoint in their middle.
    start_step = max(args.intervals) // 2

    def fresh():
        return lm.fresh_state(step=start_step)  # each loop its own optimizer object

    root = tempfile.mkdtemp(prefix="bench_interval_")

    def make_loops(n: int) -> dict[str, dict]:
        loops = {}
        for checksums in {"on": [True], "off": [False], "both": [True, False]}[args.checksums]:
            kind = "overlap" if checksums else "overlap, no checksums"
            directory = os.path.join(root, f"overlap_{n}" if checksums else f"overlap_no_checksums_{n}")
            store = oc.storage.CheckpointStore(directory, checksums=checksums)
            mngr = oc.CheckpointManager(store=store, save_interval_steps=n, window=window)
            state = mngr.prepare(fresh())
            mngr.compile_ahead(train_step, state, batches[0])
            loops[f"{kind} N={n}"] = {"state": state, "n": n, "mngr": mngr, "t": start_step}
        if not args.no_orbax:
            omngr = orbax_async_manager(os.path.join(root, f"orbax_{n}"), n)
            loops[f"orbax async N={n}"] = {"state": fresh(), "n": n, "omngr": omngr, "t": start_step}
        return loops

    def drain(loop: dict) -> None:
        if "mngr" in loop:
            loop["mngr"].wait_until_finished()
        elif "omngr" in loop:
            loop["omngr"].wait_until_finished()

    def run_block(loop: dict, on: bool, next_on: bool) -> dict:
        """The block's seconds, its drain's seconds, the checkpoints it committed, and the
        process's CPU seconds and minor page faults over block and drain.

        overlap_ckpt attaches a window's ticket at the step before it, so a window is
        skipped one step ahead, the next block's first one (``next_on``) included."""
        state, n, first = loop["state"], loop["n"], loop["t"]
        mngr, omngr = loop.get("mngr"), loop.get("omngr")

        def skip_ahead(t: int) -> None:
            version = mngr.engine.schedule.target(t + 1)
            if version is not None and not (on if t + 1 < first + block else next_on):
                mngr.engine.windows.skip(version)

        before, threads_before = resource.getrusage(resource.RUSAGE_SELF), thread_cpu.read()
        persisted = len(mngr.store.history) if mngr is not None else 0
        saved = 0
        syncs = []  # seconds from the block's start to each fetched loss
        # The training thread's wall time, by what it was doing: in the jitted step's call
        # (dispatch, and a wait where the runtime blocks it), in the checkpointer's per-step
        # call (mngr.step or Orbax's save), and at a loss fetch (waiting for the device).
        spent = {"dispatch_s": 0.0, "checkpointer_s": 0.0, "fetch_s": 0.0}
        start = time.perf_counter()
        for t in range(first, first + block):
            mark = time.perf_counter()
            state, loss = train_step(state, batches[t % len(batches)])
            called = time.perf_counter()
            spent["dispatch_s"] += called - mark
            if mngr is not None:
                skip_ahead(t)
                called = time.perf_counter()
                state = mngr.step(state)
            elif on and (t + 1) % n == 0:
                saved += bool(orbax_save(omngr, t + 1, state))
            mark = time.perf_counter()
            spent["checkpointer_s"] += mark - called
            if (args.sync_every and (t + 1 - first) % args.sync_every == 0) or t == first + block - 1:
                float(loss)
                syncs.append(time.perf_counter() - start)
                spent["fetch_s"] += time.perf_counter() - mark
        end = time.perf_counter()
        drain(loop)
        drained = time.perf_counter()
        loop["state"], loop["t"] = state, first + block
        if mngr is not None:
            saved = len(mngr.store.history) - persisted
        after, threads_after = resource.getrusage(resource.RUSAGE_SELF), thread_cpu.read()
        cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        by_thread = thread_cpu.with_ended(thread_cpu.by_group(threads_before, threads_after), cpu_s)
        return {"on": on, "first_step": first, "block_s": end - start, "drain_s": drained - end, "ckpts": saved,
                "cpu_s": cpu_s, "minor_faults": after.ru_minflt - before.ru_minflt, "sync_s": syncs, **spent,
                "thread_cpu_s": by_thread}

    # Each loop's blocks: on, off unmeasured (compiles, warms up, one checkpoint of each
    # kind), then on-off in even rounds and off-on in odd ones. One interval's loops at a
    # time: two overlap_ckpt managers taking turns in one process recompiled their window
    # steps on the training thread (seen with JAX_LOG_COMPILES).
    plan = [(-1, True), (-1, False)] + [(r, on) for r in range(args.rounds)
                                        for on in ((True, False) if r % 2 == 0 else (False, True))]
    rows: dict[str, list[dict]] = {}
    for n in args.intervals:
        loops = make_loops(n)
        for name in loops:
            rows[name] = []
        for i, (r, on) in enumerate(plan):
            next_on = plan[i + 1][1] if i + 1 < len(plan) else True
            for name, loop in loops.items():
                row = run_block(loop, on, next_on)
                if r >= 0:
                    rows[name].append({"round": r, **row})
        for loop in loops.values():
            (loop.get("mngr") or loop["omngr"]).close()
    shutil.rmtree(root, ignore_errors=True)

    report = {"benchmark": "bench_interval", "model": args.model, "batch_size": args.batch_size,
              "intervals": args.intervals, "block": block, "window": args.window, "rounds": args.rounds,
              "sync_every": args.sync_every, "checksums": args.checksums, "device": str(lm.device),
              "loadavg_at_end": list(os.getloadavg()), "rows": rows}
    report["summary"] = summarize(report)
    publish(report, markdown(report), args.out)
    return report


def kind_of(name: str) -> str:
    """The kind of a loop (``"overlap"``, ``"orbax async"``, ...), from its name (``"<kind> N=<n>"``)."""
    return name.rsplit(" N=", 1)[0]


def interval_of(name: str) -> int:
    """The checkpoint interval of a loop, from its name (``"<kind> N=<n>"``)."""
    return int(name.rsplit(" N=", 1)[1])


def summarize(report: dict) -> dict:
    """Per loop, the figures of the report's table from its blocks (``report["rows"]``)."""
    rows = report["rows"]
    sync_every = report["sync_every"] or report["block"]  # 0: one segment, the whole block

    def rounds_of(name: str) -> list[tuple[dict, dict]]:
        """The (on, off) blocks of each round of a loop."""
        return [tuple(next(row for row in rows[name] if row["round"] == r and row["on"] == flag)
                      for flag in (True, False)) for r in range(report["rounds"])]

    def by_round(name: str, value) -> list[float]:
        """Each round's (``value`` of the on block - of the off block) / checkpoints."""
        return [(value(on) - value(off)) / on["ckpts"] for on, off in rounds_of(name)]

    def per_ckpt(name: str, value) -> float:
        """Median over rounds of :func:`by_round`."""
        return statistics.median(by_round(name, value))

    def total(row: dict) -> float:
        return row["block_s"] + row["drain_s"]

    def orbax_minus(name: str) -> list[float] | None:
        """Round by round, Orbax async's total cost per checkpoint minus this loop's, at the
        same interval. A round runs every loop's blocks within a few minutes, so the drift
        between rounds, which dominates the medians above, cancels in the difference."""
        orbax = f"orbax async N={interval_of(name)}"
        if name == orbax or orbax not in rows:
            return None
        return [theirs - ours for theirs, ours in zip(by_round(orbax, total), by_round(name, total))]

    def ckpt_segments(name: str, on: dict) -> list[int]:
        """The loss-fetch segments of block ``on`` that hold a step reading a checkpoint's
        version, in order."""
        n, first = interval_of(name), on["first_step"]
        return sorted({(v - first) // sync_every for v in range(first, first + report["block"]) if v % n == 0})

    def per_ckpt_segments(name: str) -> tuple[float, float]:
        """Median over rounds of the seconds per checkpoint that the on block's loss-fetch
        segments add to the off block's median segment: (the segments that hold the step
        reading a checkpoint's version, where its copy and its stall land; every other
        segment, where background work would spill). A segment's median is robust to the
        block-to-block drift that dominates whole-block differences at long intervals."""
        own, other = [], []
        for on, off in rounds_of(name):
            base = statistics.median(segments(off["sync_s"]))
            marked = set(ckpt_segments(name, on))
            deltas = [s - base for s in segments(on["sync_s"])]
            own.append(sum(d for i, d in enumerate(deltas) if i in marked) / on["ckpts"])
            other.append(sum(d for i, d in enumerate(deltas) if i not in marked) / on["ckpts"])
        return statistics.median(own), statistics.median(other)

    def spill_after(name: str) -> list[float] | None:
        """Round by round, the seconds per checkpoint that the segments after the last
        checkpoint's segment add, each set against the segments before the first one in the
        same on block (every segment as on minus off at the same position): a drift of the
        whole block, which dominates the other-segments figure at long intervals, cancels,
        and what is left is background work (persist, release) slowing the steps after the
        checkpoint. None unless a block has two segments before its first checkpoint and
        after its last (at N=50 in 50-step blocks; never at N=10)."""
        by_round = []
        for on, off in rounds_of(name):
            marked = ckpt_segments(name, on)
            deltas = [a - b for a, b in zip(segments(on["sync_s"]), segments(off["sync_s"]))]
            before, after = deltas[:marked[0]], deltas[marked[-1] + 1:]
            if len(before) < 2 or len(after) < 2:
                return None
            drift = statistics.median(before)
            by_round.append(sum(d - drift for d in after) / on["ckpts"])
        return by_round

    def breakdown(name: str) -> dict:
        """Median over rounds of what a checkpoint adds, per checkpoint, to the training
        thread's time in each kind of call and to each thread group's CPU seconds (reports
        from before these were recorded have neither)."""
        if "thread_cpu_s" not in rows[name][0]:
            return {}
        groups = sorted({g for row in rows[name] for g in row["thread_cpu_s"]})
        return {"training_thread_per_ckpt_s": {key: per_ckpt(name, lambda row, key=key: row[key])
                                               for key in ("dispatch_s", "checkpointer_s", "fetch_s")},
                "thread_cpu_s_per_ckpt": {g: per_ckpt(name, lambda row, g=g: row["thread_cpu_s"].get(g, 0.0))
                                          for g in groups}}

    return {name: {"n": interval_of(name),
                   "block_on_s_median": statistics.median(row["block_s"] for row in rows[name] if row["on"]),
                   "block_off_s_median": statistics.median(row["block_s"] for row in rows[name] if not row["on"]),
                   "per_ckpt_training_s": per_ckpt(name, lambda row: row["block_s"]),
                   "per_ckpt_total_s": per_ckpt(name, total),
                   "orbax_minus_this_by_round_s": orbax_minus(name),
                   "cpu_s_per_ckpt": per_ckpt(name, lambda row: row["cpu_s"]),
                   "minor_faults_per_ckpt": per_ckpt(name, lambda row: row["minor_faults"]),
                   **dict(zip(("ckpt_segments_s", "other_segments_s"), per_ckpt_segments(name))),
                   "spill_after_by_round_s": spill_after(name),
                   **breakdown(name)}
            for name in rows}


def segments(sync_s: list[float]) -> list[float]:
    """Seconds between consecutive loss fetches of a block (``sync_s`` counts from its start)."""
    return [b - a for a, b in zip([0.0, *sync_s[:-1]], sync_s)]


def markdown(report: dict) -> str:
    summary = report["summary"]
    lines = [f"# Cost per checkpoint by interval: {report['model']}, one process, {report['rounds']} rounds",
             "",
             f"Blocks of {report['block']} steps, checkpointing on and off in turn in the same loop; loss fetched "
             + (f"every {report['sync_every']} steps" if report["sync_every"] else
                "only at each block's last step (no sync of any kind inside a block)")
             + f"; overlap window {report['window']}; load average at the end "
             f"{report['loadavg_at_end'][0]:.1f}.",
             "",
             "| loop | N | block s on / off (median) | per checkpoint, training thread ms | per checkpoint, total ms | "
             "x Orbax async (total) | checkpoint's segment ms | other segments ms | "
             "CPU s per checkpoint | minor faults per checkpoint (MiB of 4 KiB pages) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, s in summary.items():
        n = s["n"]
        orbax = summary.get(f"orbax async N={n}")
        ratio = (f"{s['per_ckpt_total_s'] / orbax['per_ckpt_total_s']:.2f}"
                 if orbax and orbax["per_ckpt_total_s"] > 0 else "-")
        faults = s["minor_faults_per_ckpt"]
        lines.append(f"| {name} | {n} | {s['block_on_s_median']:.2f} / {s['block_off_s_median']:.2f} | "
                     f"{s['per_ckpt_training_s'] * 1e3:.0f} | {s['per_ckpt_total_s'] * 1e3:.0f} | {ratio} | "
                     f"{s['ckpt_segments_s'] * 1e3:.0f} | {s['other_segments_s'] * 1e3:.0f} | "
                     f"{s['cpu_s_per_ckpt']:.2f} | {faults:.0f} ({faults * 4096 / 2**20:.0f}) |")
    broken_down = {name: s for name, s in summary.items() if "thread_cpu_s_per_ckpt" in s}
    if broken_down:
        groups = sorted({g for s in broken_down.values() for g, v in s["thread_cpu_s_per_ckpt"].items()
                         if abs(v) >= 0.005}, key=lambda g: -max(abs(s["thread_cpu_s_per_ckpt"].get(g, 0.0))
                                                                 for s in broken_down.values()))
        lines += ["", "Where a checkpoint's time goes, per checkpoint (on block - off block, median over rounds). "
                      "Training thread: wall time in the jitted step's call, in the checkpointer's per-step call "
                      "(`mngr.step`, Orbax's `save`) and at loss fetches; then CPU seconds by thread over block "
                      "and drain (groups with 5 ms or more).", "",
                  "| loop | N | in step call ms | in checkpointer ms | at fetches ms | "
                  + " | ".join(f"{g} CPU ms" for g in groups) + " |",
                  "|---|--:|--:|--:|--:|" + "--:|" * len(groups)]
        for name, s in broken_down.items():
            wall = s["training_thread_per_ckpt_s"]
            cpu = s["thread_cpu_s_per_ckpt"]
            lines.append(f"| {name} | {s['n']} | " + " | ".join(
                f"{wall[k] * 1e3:.0f}" for k in ("dispatch_s", "checkpointer_s", "fetch_s")) + " | "
                + " | ".join(f"{cpu.get(g, 0.0) * 1e3:.0f}" for g in groups) + " |")
    for name, s in summary.items():
        diffs = s.get("orbax_minus_this_by_round_s")
        if diffs:
            lines += ["", f"{name} against Orbax async, round by round: Orbax's checkpoint cost more in "
                          f"{sum(d > 0 for d in diffs)} of {len(diffs)} rounds (median difference "
                          f"{statistics.median(diffs) * 1e3:.0f} ms per checkpoint)"]
    for name, s in summary.items():
        spill = s.get("spill_after_by_round_s")
        if spill:
            lines += ["", f"{name}: the segments after the checkpoint, against those before it in the same "
                          f"block, add {statistics.median(spill) * 1e3:.0f} ms per checkpoint (median over "
                          f"rounds; {min(spill) * 1e3:.0f} to {max(spill) * 1e3:.0f}; more in "
                          f"{sum(d > 0 for d in spill)} of {len(spill)} rounds)"]
    for kind in dict.fromkeys(map(kind_of, summary)):
        for key, what in (("per_ckpt_total_s", "total cost"), ("ckpt_segments_s", "checkpoint's segment")):
            costs = {s["n"]: s[key] for name, s in summary.items() if kind_of(name) == kind}
            if len(costs) >= 2:
                short, long_ = min(costs), max(costs)
                lines.append("")
                if costs[short] <= 0 or costs[long_] <= 0:
                    # A checkpoint never makes its loop faster: a cost at or below zero is the
                    # drift between blocks, and a ratio to it would mean nothing.
                    lines.append(f"{kind}: {what} per checkpoint at N={long_} against N={short}: not resolved "
                                 f"({costs[short] * 1e3:.0f} and {costs[long_] * 1e3:.0f} ms; a cost at or below "
                                 "zero is drift between blocks)")
                    continue
                lines.append(f"{kind}: {what} per checkpoint at N={long_} is "
                             f"{costs[long_] / costs[short]:.2f}x the one at N={short} (target for overlap: <= 1.2x)")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
