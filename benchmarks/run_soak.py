"""``benchmarks.run --soak C``: host RSS over C checkpoints, overlap auto-K against Orbax async.

Why a mode of its own: the report's peak RSS is one figure after a short span, which cannot
show memory that grows checkpoint by checkpoint (freed host copies kept in malloc's arenas,
issue 20). This runs no checkpointing, overlap auto-K and Orbax async, one fresh process
each, for C checkpoints at the first interval, and records RSS after every step: growth
from the 10th checkpoint to the last is the figure. Writes ``<out>_soak.json`` and
``<out>_rss.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

from benchmarks.run_configs import DEFAULT_BATCH_SIZE, LABELS
from benchmarks.run_report import ms
from benchmarks.run_worker import run_worker, worker_env


def soak(args: argparse.Namespace) -> dict:
    """Host RSS over ``args.soak`` checkpoints at N = the first interval: overlap auto-K and
    Orbax async, one fresh process each; RSS after the 10th and the last checkpoint."""
    n = args.intervals[0]
    batch_size = args.batch_size or DEFAULT_BATCH_SIZE[args.model]
    ckpt_root = tempfile.mkdtemp(prefix="overlap_soak_", dir=os.path.abspath(args.ckpt_dir or tempfile.gettempdir()))
    env = worker_env(args.platform, None)
    common = {"model": args.model, "batch_size": batch_size, "platform": args.platform, "ckpt_root": ckpt_root,
              "restore_repeats": 1, "optimizer": args.optimizer, "compile_ahead": True,
              "sync_every": args.sync_every, "on_host_budget": args.on_host_budget}
    s0 = max(0, n - args.warmup_steps)
    out = {"benchmark": "soak", "model": args.model, "interval": n, "checkpoints": args.soak,
           "sync_every": args.sync_every, "runs": {}}
    try:
        base_mean = None
        for cfg in ("none", "overlap_auto", "orbax_async"):
            run = run_worker({**common, "config": cfg, "interval": n, "start_step": s0, "warmup": n - s0 + 1,
                              "steps": args.soak * n, "distinct_batches": 16}, env, args.timeout)
            rss = [r["rss"] for r in run["steps"]]
            dts = [r["end"] - r["start"] for r in run["steps"]]
            if cfg == "none":
                base_mean = statistics.mean(dts)
                continue
            at10, last = rss[10 * n - 1], rss[-1]
            committed = len(run["persist"]) if "persist" in run else sum(r["save"] for r in run["steps"])
            r = out["runs"][cfg] = {
                "rss": rss, "rss_after_10": at10, "rss_after_last": last, "growth_vs_10": last / at10 - 1,
                "state_bytes": run["state_bytes"], "committed": committed, "host_budget": run.get("host_budget"),
                "ettr": base_mean / statistics.mean(dts),
                "stall_span_per_ckpt_s": (sum(dts) - len(dts) * base_mean) / committed if committed else None}
            print(f"{cfg}: {committed} committed, ETTR {r['ettr']:.3f}, stall/ckpt over the span "
                  f"{ms(r['stall_span_per_ckpt_s'])} ms; RSS after 10 checkpoints {at10 / 2**20:.0f} MiB, "
                  f"after {args.soak}: {last / 2**20:.0f} MiB ({r['growth_vs_10']:+.1%}); "
                  f"{(run.get('host_budget') or {}).get('text', '')}", flush=True)
    finally:
        shutil.rmtree(ckpt_root, ignore_errors=True)
    out["no_checkpoint_mean_step_s"] = base_mean
    with open(args.out + "_soak.json", "w") as fh:
        json.dump(out, fh)
    _plot(out, args.out + "_rss.png")
    return out


def _plot(out: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no RSS plot: pip install -e '.[bench]'")
        return
    n = out["interval"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for cfg, r in out["runs"].items():
        ax.plot([x / 2**20 for x in r["rss"]], label=f"{LABELS[cfg]} ({r['growth_vs_10']:+.1%} from ckpt 10)")
    ax.axvline(10 * n - 1, color="grey", ls=":", lw=1)
    ax.set_xlabel(f"measured step (a checkpoint every {n} steps)")
    ax.set_ylabel("RSS MiB")
    ax.set_title(f"{out['model']}: host RSS over {out['checkpoints']} checkpoints")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
