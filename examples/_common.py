"""Flags and set-up shared by the example training scripts."""

from __future__ import annotations

import argparse
import os


def parse_args(description: str, default_dir: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--platform", choices=["cpu", "gpu", "tpu"], default="cpu",
                    help="JAX backend to train on (default: cpu)")
    ap.add_argument("--model", default="tiny", help="LMConfig preset: tiny, small, 20m, 100m, 1b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8, help="global batch, split over all devices")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=default_dir,
                    help="checkpoint directory: a path, or a URL such as gs://bucket/run or s3://bucket/run")
    ap.add_argument("--interval", type=int, default=50, help="save a checkpoint every N steps")
    ap.add_argument("--window", default="auto", help="window size K, or 'auto' (K=1 on CPU)")
    ap.add_argument("--max-to-keep", type=int, default=3)
    args = ap.parse_args()
    args.window = args.window if args.window == "auto" else int(args.window)
    # Must happen before jax is imported. The accelerator first (the default backend), and the
    # CPU beside it: windows of K > 1 steps are replayed on the host with JAX's CPU backend.
    os.environ.setdefault("JAX_PLATFORMS", args.platform if args.platform == "cpu" else f"{args.platform},cpu")
    return args


def data_mesh():
    """A 1-D mesh over every local device: batches are split along 'data', the train
    state is replicated (each device holds it; overlap_ckpt writes one copy)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    return mesh, NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
