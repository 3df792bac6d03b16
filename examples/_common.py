"""Flags and set-up shared by the example training scripts."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable


def parse_args(description: str, default_dir: str,
               add_options: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The shared flags, plus a script's own (``add_options(parser)``)."""
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
    if add_options is not None:
        add_options(ap)
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


def launch_local_processes(n: int) -> int:
    """Run this script as the ``n`` processes of one ``jax.distributed`` job on this machine
    (CPU: tests, debugging) and return its exit status.

    Each child is this command line plus ``--process-id i --coordinator 127.0.0.1:<port>``
    (a free port), its output prefixed with ``[i]``. When one child fails the others are
    killed at once: they would wait for it in a collective until jax's heartbeat timeout,
    and a checkpoint step is committed atomically (a killed write is never restored). When
    this launcher is interrupted (Ctrl-C, SIGTERM) they get 10 s to exit. The children share
    this process's group, so Ctrl-C or ``kill -9 -<pgid>`` reaches them all at once."""
    import signal
    import socket
    import subprocess
    import threading
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # lines arrive as printed, also when killed
    children = [subprocess.Popen([sys.executable, *sys.argv, "--process-id", str(i),
                                  "--coordinator", f"127.0.0.1:{port}"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(n)]

    def relay(i: int, child: subprocess.Popen) -> None:
        for line in child.stdout:
            sys.stdout.write(f"[{i}] {line}")
            sys.stdout.flush()

    relays = [threading.Thread(target=relay, args=(i, c), daemon=True) for i, c in enumerate(children)]
    for t in relays:
        t.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # runs the finally below
    failed = None  # the first failure's status
    try:
        while failed is None:
            codes = [c.poll() for c in children]
            if None not in codes:
                break
            failed = next((code for code in codes if code), None)
            time.sleep(0.1)
    finally:  # a child failed (the others would wait for it in a collective), or Ctrl-C, SIGTERM
        deadline = time.monotonic() + (0 if failed else 10)
        for c in children:
            try:
                c.wait(max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                c.kill()  # not SIGTERM: jax takes it for a preemption notice and goes on
                c.wait()
        for t in relays:
            t.join(5)
    code = failed if failed is not None else next((c.returncode for c in children if c.returncode), 0)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell reports it
