"""What the training thread waited for between steps, from a profiler trace of Python threads.

    python -m benchmarks.trace_host DIR   # a `benchmarks.run --profile DIR` trace (one config's folder)

For each step the training thread issued (a top-level ``PjitFunction(<step>)`` event on the
thread that issued most of them), it prints how long the call took, how many arrays the
thread then freed (XLA's ``Wait for donation holds`` event, one per buffer released) and over
how long, and which Python the other threads ran meanwhile. Why: jaxlib releases the GIL
around freeing each array, so a thread of ours running Python at that moment stretches the
freeing of the donated state from about a millisecond to the whole of its Python
(``overlap_ckpt.gil``); the device trace alone shows only the idle gap this leaves.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

FREED = "Wait for donation holds"  # XLA's ReleaseBuffer, once per array freed
# Python calls that wait with the GIL released (a queue, a lock, a TensorStore future)
WAITS = ("$threading.py", "$queue.py", "$tensorstore")


def load_trace(trace_dir: str) -> dict:
    """The Chrome trace events of the first ``*.trace.json.gz`` under ``trace_dir``."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        return json.load(f)


def top_level(events: list[dict]) -> list[dict]:
    """The events of one thread not nested in another of that thread."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def analyse(trace: dict, step_name: str | None = None) -> list[dict]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    devices = {e["pid"] for e in events if "kernel_details" in e.get("args", {})}
    threads: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e["pid"] not in devices:
            threads[(e["pid"], e["tid"])].append(e)
    calls = collections.Counter((key, e["name"]) for key, es in threads.items() for e in top_level(es)
                                if e["name"].startswith("PjitFunction(")
                                and (step_name is None or e["name"] == f"PjitFunction({step_name})"))
    (training, name), _ = calls.most_common(1)[0]
    steps = [e for e in top_level(threads[training]) if e["name"] == name]
    frees = sorted((e for e in threads[training] if e["name"] == FREED), key=lambda e: e["ts"])
    others = {key: top_level(es) for key, es in threads.items() if key != training}
    t0 = steps[0]["ts"]
    rows = []
    for step, following in zip(steps, steps[1:] + [None]):
        lo = step["ts"] + step["dur"]
        hi = following["ts"] if following else float("inf")
        freed = [e for e in frees if lo <= e["ts"] < hi]
        until = max((e["ts"] + e["dur"] for e in freed), default=lo)
        busy: collections.Counter = collections.Counter()
        for es in others.values():
            for e in es:
                overlap = min(until, e["ts"] + e["dur"]) - max(lo, e["ts"])
                if overlap > 0 and e["name"].startswith("$") and not e["name"].startswith(WAITS):  # Python
                    busy[e["name"]] += overlap
        rows.append({"at_ms": (step["ts"] - t0) / 1e3, "call_ms": step["dur"] / 1e3, "freed": len(freed),
                     "freeing_ms": (until - lo) / 1e3, "others": busy.most_common(3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--step", default=None, help="the jitted step's function name (default: the most called)")
    args = ap.parse_args()
    print("| step at ms | call ms | arrays freed | freeing ms | other threads' Python meanwhile (ms) |")
    print("|--:|--:|--:|--:|---|")
    for r in analyse(load_trace(args.trace_dir), args.step):
        others = ", ".join(f"{n.lstrip('$')} {us / 1e3:.1f}" for n, us in r["others"]) or "-"
        print(f"| {r['at_ms']:.1f} | {r['call_ms']:.1f} | {r['freed']} | {r['freeing_ms']:.1f} | {others} |")


if __name__ == "__main__":
    main()
