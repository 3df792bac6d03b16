"""Where a checkpoint's host memory goes, window size by window size, measured in one process each.

    python -m benchmarks.bench_host_memory --model 20m --batch-size 2 --windows 1 3 \
        --out benchmarks/results/cpu_20m_host_memory

Why: ``benchmarks.run`` reports one figure, the peak RSS above the no-checkpoint run's, and
issue 20 bounds it at 1.25x the state. That figure mixes memory that grows with the state
(the host copy, what the replay and the writer hold besides it) with memory that does not:
the compiled programs a window adds (one step variant per window phase, the host replay's
programs), which on XLA:CPU take tens of MiB each whatever the state's size. Which of the
two misses the bound decides what to fix, so this benchmark measures them apart, in a fresh
process per window size (after ``malloc_trim``, so freed heap pages do not count):

* **step variants**: RSS added by ``compile_ahead`` (joined): the K programs of the window
  phases;
* **first checkpoint, fixed**: RSS added by the first checkpoint (its window, replay and
  persist, then drained and its captured views released) less what the engine keeps for
  the next window (``kept_host_bytes``): the replay's compiled programs and the writer's
  contexts and threads;
* **kept between windows**: ``kept_host_bytes``, the replayed slices' buffers reused by the
  next window (K > 1);
* **window peak**: the highest RSS from the second window's first step until two steps after
  its persist ended, above the highest RSS of the plain steps before that window, sampled
  every millisecond. Both include the step's own temporaries, so the difference is what the
  checkpoint holds while a step runs: the copy (minus what is kept, already in both) and
  its scratch.

Each part also lists the memory mappings of 1 MiB or more that it added, with their resident
size (``new_mappings``): on a GPU the outboxes are pinned host memory from XLA's caching pool,
whose regions show there as mappings that stay once grown.

The state-proportional part is ``kept + window peak``: what ``max_host_bytes`` bounds. The
sum of all four approximates the peak above a plain loop with every program compiled; it is
not the same measurement as ``benchmarks.run``'s peak (VmHWM, whose no-checkpoint run also
holds its own compile's transient). Compile-time transients (LLVM's own memory while compiling) are
left out: they do not recur, and ``benchmarks.run``'s VmHWM includes them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

from benchmarks.harness import rss_now, run_fresh, settled_rss, tree_bytes
from benchmarks.reporting import publish

MIB = 2**20


def resident_mappings(min_bytes: int = MIB) -> dict[str, tuple[int, int, str]]:
    """This process's mappings of at least ``min_bytes``: address range -> (size, resident
    bytes, what is mapped), from ``/proc/self/smaps`` (empty where there is none)."""
    found: dict[str, tuple[int, int, str]] = {}
    try:
        with open("/proc/self/smaps") as f:
            key = None
            for line in f:
                head = line.split()
                if "-" in head[0] and not head[0].endswith(":"):
                    lo, hi = (int(a, 16) for a in head[0].split("-"))
                    key = head[0] if hi - lo >= min_bytes else None
                    if key:
                        found[key] = (hi - lo, 0, head[5] if len(head) > 5 else "[anonymous]")
                elif key and head[0] == "Rss:":
                    size, _, what = found[key]
                    found[key] = (size, int(head[1]) * 1024, what)
    except OSError:
        pass
    return found


def new_mappings(before: dict, after: dict) -> list[list]:
    """Mappings in ``after`` that are not in ``before`` (or grew): [MiB, resident MiB, what]."""
    return sorted(([round(size / MIB, 1), round(rss / MIB, 1), what] for key, (size, rss, what) in after.items()
                   if rss > before.get(key, (0, 0, ""))[1] + MIB), reverse=True)


def worker(model: str, batch_size: int, k: int, interval: int) -> dict:
    import jax

    import overlap_ckpt as oc

    from benchmarks.lm_loop import lm_loop

    lm = lm_loop(model, batch_size)
    state = lm.fresh_state()
    state_bytes = tree_bytes(state.params) + tree_bytes(state.opt_state)
    t = 0

    def step(s):
        nonlocal t
        s, loss = lm.train_step(s, lm.batches[t % len(lm.batches)])
        if mngr is not None:
            s = mngr.step(s)
        jax.block_until_ready((s, loss))
        t += 1
        return s

    mngr = None
    state = step(state)  # the plain program, compiled and run once
    root = tempfile.mkdtemp(prefix="bench_host_memory_")
    mngr = oc.CheckpointManager(root, save_interval_steps=interval, window=k)
    state = mngr.prepare(state)
    before_variants = settled_rss()
    maps_before = resident_mappings()
    compiling = mngr.compile_ahead(lm.train_step, state, lm.batches[0])
    state = step(state)  # compile_ahead starts after the first step
    compiling.join()
    variants = settled_rss() - before_variants
    while t <= interval + 1:  # through the first window
        state = step(state)
    mngr.wait_until_finished()
    mngr.engine.release_idle_buffers()  # the persisted capture's views, as the next step would
    mngr.engine.flush()
    kept = mngr.engine.kept_host_bytes
    first_checkpoint = settled_rss() - before_variants - variants
    maps_first = resident_mappings()

    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append((time.perf_counter(), rss_now()))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    marks = []  # (t, window phase or None, start, end)
    history = len(mngr.store.history)
    while t < 2 * interval + 3:
        phase, start = mngr.next_window_phase, time.perf_counter()
        state = step(state)
        marks.append((t - 1, phase, start, time.perf_counter()))
    mngr.wait_until_finished()
    stop.set()
    sampler.join()
    persist = mngr.store.history[history]
    persist_end = persist.started_perf_s + persist.persist_seconds
    window_start = min(start for _, phase, start, _ in marks if phase is not None)
    after = [end for _, _, _, end in marks if end > persist_end]
    window_end = after[min(1, len(after) - 1)] if after else marks[-1][3]

    def peak(lo: float, hi: float) -> int:
        return max((r for ts, r in samples if lo <= ts < hi), default=0)

    plain_peak = peak(marks[0][2], window_start)
    window_peak = peak(window_start, window_end)
    k_used = int(mngr.engine.schedule.k)
    maps_second = resident_mappings()
    mngr.close()
    return {"k": k_used, "state_bytes": state_bytes,
            "step_variants_bytes": variants, "first_checkpoint_fixed_bytes": first_checkpoint - kept,
            "kept_bytes": kept, "plain_peak_bytes": plain_peak, "window_peak_bytes": window_peak,
            "window_extra_bytes": window_peak - plain_peak,
            "steps": [list(m) for m in marks], "persist_s": persist.persist_seconds,
            "new_mappings": {"variants_and_first_checkpoint": new_mappings(maps_before, maps_first),
                             "second_checkpoint": new_mappings(maps_first, maps_second)}}


def markdown(report: dict) -> str:
    lines = [f"# Host memory of a checkpoint by part: {report['model']}, interval {report['interval']}", "",
             f"State (params + adamw) {report['runs'][0]['state_bytes'] / MIB:.1f} MiB; one fresh process "
             "per window size; MiB (x state).", "",
             "| K | step variants | first checkpoint, fixed | kept between windows | window peak above plain steps "
             "| state-proportional (kept + window) | sum |",
             "|--:|--:|--:|--:|--:|--:|--:|"]
    for r in report["runs"]:
        s = r["state_bytes"]

        def cell(b):
            return f"{b / MIB:.0f} ({b / s:.2f}x)"

        proportional = r["kept_bytes"] + r["window_extra_bytes"]
        total = r["step_variants_bytes"] + r["first_checkpoint_fixed_bytes"] + proportional
        lines.append(f"| {r['k']} | {cell(r['step_variants_bytes'])} | {cell(r['first_checkpoint_fixed_bytes'])} | "
                     f"{cell(r['kept_bytes'])} | {cell(r['window_extra_bytes'])} | {cell(proportional)} | "
                     f"{cell(total)} |")
    lines += ["", "Columns: see the module docstring of `benchmarks/bench_host_memory.py`.", "",
              "Mappings of 1 MiB or more added (MiB mapped / resident, what; the largest 8):", ""]
    for r in report["runs"]:
        for part, maps in r.get("new_mappings", {}).items():
            shown = ", ".join(f"{size:.0f}/{rss:.0f} {what}" for size, rss, what in maps[:8])
            lines.append(f"- K={r['k']}, {part.replace('_', ' ')}: {len(maps)} mappings; {shown or 'none'}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", choices=("tiny", "small", "20m", "100m"))
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--out", default=None, help="output prefix: <out>.json and <out>.md")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.model, args.batch_size, args.worker, args.interval)))
        return {}
    if any(k >= args.interval for k in args.windows):
        ap.error("every window must be shorter than --interval")
    runs = []
    for k in args.windows:
        runs.append(run_fresh("benchmarks.bench_host_memory",
                              ["--model", args.model, "--batch-size", str(args.batch_size),
                               "--interval", str(args.interval), "--worker", str(k)],
                              env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")},
                              label=f"K={k}"))
    report = {"benchmark": "bench_host_memory", "model": args.model, "batch_size": args.batch_size,
              "interval": args.interval, "runs": runs, "loadavg_at_end": list(os.getloadavg())}
    publish(report, markdown(report), args.out)
    return report


if __name__ == "__main__":
    main()
