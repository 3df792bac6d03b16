"""Persist throughput to a local S3 server (moto) vs a local disk, for a ~128 MiB state.

    python -m benchmarks.bench_s3 [--mib 128] [--repeats 3]

Measures ``CheckpointStore.save`` + ``wait_until_finished`` (commit included) of the same
float32 tree (16 leaves) to ``s3://`` on a moto server on 127.0.0.1 and to a temporary
local directory; prints the median GiB/s of each (2**30 bytes per second). Moto keeps
objects in Python memory behind a single-process HTTP server, so the S3 number measures
the protocol path (multipart PUTs, commit marker), not a real object store's bandwidth.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import numpy as np

GIB = 2**30


def state(mib: float, leaves: int = 16) -> dict:
    rng = np.random.default_rng(0)
    n = int(mib * 2**20 / 4 / leaves)
    return {f"w{i:02d}": rng.standard_normal(n, dtype=np.float32) for i in range(leaves)}


def persist(directory, tree, repeats: int) -> list[float]:
    from overlap_ckpt.storage import CheckpointStore
    times = []
    with CheckpointStore(directory, max_to_keep=1) as store:
        for step in range(repeats + 1):  # the first one warms up (connections, allocations)
            start = time.perf_counter()
            store.save(step, tree)
            store.wait_until_finished()
            if step:
                times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    import boto3
    from moto.server import ThreadedMotoServer

    tree = state(args.mib)
    nbytes = sum(a.nbytes for a in tree.values())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        s3 = {"driver": "s3", "bucket": "bench", "path": "run/", "endpoint": endpoint,
              "aws_region": "us-east-1"}
        s3_times = persist(s3, tree, args.repeats)
    finally:
        server.stop()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        disk_times = persist(os.path.join(d, "ckpt"), tree, args.repeats)
    print(f"state: {nbytes / 2**20:.0f} MiB in {len(tree)} leaves, {args.repeats} repeats (median)")
    for name, times in (("local S3 (moto)", s3_times), ("local disk", disk_times)):
        t = statistics.median(times)
        print(f"persist to {name:16s}: {nbytes / GIB / t:6.2f} GiB/s  ({t:.2f} s; all: "
              + ", ".join(f"{x:.2f}" for x in times) + ")")


if __name__ == "__main__":
    main()
