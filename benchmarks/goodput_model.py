"""Predicted goodput under failures: Orbax async, overlap durable-only, overlap + local tier.

Run from the repository root::

    python -m benchmarks.goodput_model --out benchmarks/results/goodput_model_1b_h100.md

Goodput is the fraction of wall-clock time that ends up as training kept after failures:

    goodput = ETTR(checkpoint overhead) x (1 - failures_per_s x E[seconds lost per failure])

ETTR comes from :func:`overlap_ckpt.costmodel.estimate` (stall plus queueing per
checkpoint). A failure loses the restart, the restore and the work since the last
*committed* checkpoint: on average half an interval plus the write of a checkpoint (it
counts only once committed). With a local tier a failure whose host survives (a crashed
process, a restart on the same node) resumes from the local tier; one that loses the host
resumes from the durable tier (no peer replicas). Each configuration gets the interval that
maximises its goodput (a sweep), never shorter than its own writes allow.
"""

from __future__ import annotations

import argparse
import dataclasses

from overlap_ckpt.costmodel import TrainingProfile, estimate

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Assumptions:
    params: float = 1e9
    state_bytes_per_param: float = 16.0  # fp32 params + adam mu/nu + fp32 master: mixed-precision adam
    grad_bytes_per_param: float = 2.0  # bf16 gradients
    step_time_s: float = 1.0
    d2h_bytes_per_s: float = 50 * GB  # H100 PCIe Gen5 pinned D2H (simulate's h100-pcie5 preset)
    durable_bytes_per_s: float = 1 * GB  # shared network storage per node
    local_bytes_per_s: float = 5 * GB  # tmpfs write incl. checksums (a memcpy-bound host)
    restart_s: float = 120.0  # reschedule, process start, jit compile
    host_survives: float = 0.5  # share of failures after which the same host restarts the process

    @property
    def state_bytes(self) -> float:
        return self.params * self.state_bytes_per_param


def _profile(a: Assumptions, persist_bytes_per_s: float) -> TrainingProfile:
    return TrainingProfile(a.step_time_s, a.d2h_bytes_per_s, a.state_bytes, a.params * a.grad_bytes_per_param,
                           persist_bytes_per_s)


def _best(goodput, intervals):
    return max(((goodput(n), n) for n in intervals), key=lambda gn: gn[0])


def predict(a: Assumptions, mtbf_s: float) -> dict[str, tuple[float, str]]:
    rate = 1.0 / mtbf_s
    durable, local = _profile(a, a.durable_bytes_per_s), _profile(a, a.local_bytes_per_s)
    restore_durable, restore_local = a.state_bytes / a.durable_bytes_per_s, a.state_bytes / a.local_bytes_per_s
    intervals = range(1, 20001)

    def lost(n, est, restore_s):
        return a.restart_s + restore_s + n * a.step_time_s / 2 + est.background_s + est.queue_wait_s

    def single(strategy):
        def goodput(n):
            est = estimate(durable, strategy, 1, n)
            return est.ettr * (1 - rate * lost(n, est, restore_durable))
        return goodput

    out = {}
    for label, strategy in (("Orbax async (durable)", "async"), ("overlap_ckpt durable-only", "overlap")):
        g, n = _best(single(strategy), intervals)
        out[label] = (g, f"durable every {n} steps")
    g_dur, n_dur = _best(single("overlap"), intervals)

    def tiered(n):
        est = estimate(local, "overlap", 1, n)
        est_d = estimate(durable, "overlap", 1, n_dur)
        loss = a.host_survives * lost(n, est, restore_local) + (1 - a.host_survives) * lost(n_dur, est_d, restore_durable)
        return est.ettr * (1 - rate * loss)

    g, n = _best(tiered, range(1, n_dur + 1))
    out["overlap_ckpt + local tier"] = (g, f"local every {n} steps, durable every {n_dur}")
    return out


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--host-survives", type=float, nargs="+", default=[0.5, 0.2])
    args = ap.parse_args(argv)
    lines = ["# Predicted goodput under failures: 1B model, one H100 (cost model, not a measurement)", "",
             "Produced by `python -m benchmarks.goodput_model` (see its docstring for the formula).", "",
             "Assumptions: " + ", ".join(f"`{f.name}={getattr(Assumptions(), f.name):g}`"
                                         for f in dataclasses.fields(Assumptions) if f.name != "host_survives")
             + "; state 16 GB, background writes never stall training (overlap, one host copy).", "",
             "| failures | host survives | configuration | best intervals | goodput |", "|---|--:|---|---|--:|"]
    for share in args.host_survives:
        a = Assumptions(host_survives=share)
        for mtbf_label, mtbf in (("one per 3 h", 3 * 3600.0), ("one per 13 min", 13 * 60.0)):
            for label, (g, how) in predict(a, mtbf).items():
                lines.append(f"| {mtbf_label} | {share:.0%} | {label} | {how} | {g:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
