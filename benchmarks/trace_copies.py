"""When each device-to-host copy of a GPU profiler trace runs within its program.

    python -m benchmarks.trace_copies DIR   # a jax.profiler trace (gpu_check.sh's profile.tgz, unpacked)

Reads the trace's ``*.trace.json.gz`` (Chrome trace events): the programs are the runs of
kernels on the compute stream separated by idle gaps (``--gap-ms``); for each host copy
(a ``MemcpyD2H`` event) it prints where the copy starts within the program it overlaps,
its speed, and how much of the program's compute ran during it, before it and after it.
Why: XLA's schedule says which compute lies between a copy's start and done, but only the
device says how long that compute takes beside the copy (``bench_copy_schedule``).
"""

from __future__ import annotations

import argparse

from benchmarks.trace_host import load_trace

MIB = 2**20


def busy_us(kernels: list[dict], lo: float, hi: float) -> float:
    """Microseconds of kernel time within [lo, hi)."""
    return sum(max(0.0, min(hi, k["ts"] + k["dur"]) - max(lo, k["ts"])) for k in kernels)


def analyse(trace: dict, gap_us: float) -> list[dict]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    streams = {(e["pid"], e["tid"]) for e in events if "kernel_details" in e.get("args", {})}
    devices = {pid for pid, _ in streams}  # the host's API calls carry the same names, in no time
    copies = sorted((e for e in events if e["name"] == "MemcpyD2H" and e["pid"] in devices), key=lambda e: e["ts"])
    kernels = sorted((e for e in events if (e["pid"], e["tid"]) in streams and "kernel_details" in e["args"]),
                     key=lambda e: e["ts"])
    programs: list[list[dict]] = []
    for k in kernels:
        if not programs or k["ts"] - (programs[-1][-1]["ts"] + programs[-1][-1]["dur"]) > gap_us:
            programs.append([])
        programs[-1].append(k)
    out = []
    for program in programs:
        start, end = program[0]["ts"], program[-1]["ts"] + program[-1]["dur"]
        row = {"start_us": start, "span_us": end - start, "kernels": len(program),
               "busy_us": busy_us(program, start, end), "copies": []}
        for c in copies:
            c_start, c_end = c["ts"], c["ts"] + c["dur"]
            if not start <= c_start <= end:
                continue
            size = int(c["args"].get("memcpy_details", "size:0").split("size:")[1].split()[0])
            row["copies"].append({
                "op": c["args"].get("hlo_op", ""), "bytes": size, "dur_us": c["dur"],
                "starts_at": (c_start - start) / (end - start), "ends_after_program_us": c_end - end,
                "compute_during_us": busy_us(program, c_start, c_end),
                "compute_before_us": busy_us(program, start, c_start),
                "compute_after_us": busy_us(program, c_end, end)})
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="idle time that separates two programs")
    args = ap.parse_args()
    programs = analyse(load_trace(args.trace_dir), args.gap_ms * 1e3)
    print("| program | span ms | kernels | copy | MiB | copy ms (GB/s) | starts at (of the span) | "
          "ends after the program ms | compute during / before / after the copy ms |")
    print("|--:|--:|--:|---|--:|---|--:|--:|---|")
    for n, p in enumerate(programs):
        for c in p["copies"] or [None]:
            lead = f"| {n} | {p['span_us'] / 1e3:.1f} | {p['kernels']} |"
            if c is None:
                print(lead + " - | - | - | - | - | - |")
                continue
            print(lead + f" {c['op']} | {c['bytes'] / MIB:.0f} | {c['dur_us'] / 1e3:.1f} "
                  f"({c['bytes'] / c['dur_us'] / 1e3:.1f}) | {c['starts_at']:.2f} | {c['ends_after_program_us'] / 1e3:+.1f} | "
                  f"{c['compute_during_us'] / 1e3:.1f} / {c['compute_before_us'] / 1e3:.1f} / "
                  f"{c['compute_after_us'] / 1e3:.1f} |")


if __name__ == "__main__":
    main()
