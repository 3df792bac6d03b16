"""Persist and restore time of one step in the local tier (tmpfs) vs the durable tier (a disk).

Run from the repository root::

    python -m benchmarks.bench_tiers --gib 0.25 --json benchmarks/results/tiers_restore_cpu.json
    python -m benchmarks.bench_tiers --gib 0.02          # smoke test

One host copy (bench_storage's transformer-shaped float32 tree) is written once through a
:class:`overlap_ckpt.tiers.TieredStore` to both tiers, as a durable step of a manager with
a local tier (the same arrays, by reference). Then, in interleaved rounds, the step is
restored onto a CPU sharding from each tier: the local tier under ``/dev/shm`` (memory),
the durable tier warm (page cache, as right after a save) and cold (its files evicted with
``posix_fadvise(DONTNEED)``, so the reads come from the device, as after a host restart).
Persists: the same tree written to each tier alone (a local-only step, a durable-only
one), commit and fsync included. Reported: median seconds and GiB/s over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

from .bench_storage import GIB, drop_cache, leaves_of, make_state


def main(argv=None) -> dict:
    import jax

    from overlap_ckpt import LocalTier
    from overlap_ckpt.storage import CheckpointStore
    from overlap_ckpt.tiers import TieredStore

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="durable directory's parent (default: a temp dir on disk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    state = make_state(args.gib, args.layers)
    nbytes = sum(a.nbytes for a in leaves_of(state))
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=cpu), state)
    disk = tempfile.mkdtemp(dir=args.dir or os.getcwd(), prefix=".bench_tiers_")
    shm = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="bench_tiers_")
    times: dict[str, list[float]] = {"local": [], "durable_warm": [], "durable_cold": []}
    writes: dict[str, list[float]] = {"local": [], "durable": []}
    try:
        store = TieredStore(CheckpointStore(os.path.join(disk, "durable")),
                            LocalTier(os.path.join(shm, "local"), every=1, max_to_keep=args.repeats + 1), interval=1)
        start = time.perf_counter()
        store.put(1, state)
        store.flush()
        persist_s = time.perf_counter() - start
        assert store.local.all_steps() == [1] and store.durable.all_steps() == [1]

        def restore(which):
            if which == "durable_cold":
                drop_cache(os.path.join(disk, "durable"))
            tier = store.local if which == "local" else store.durable
            t0 = time.perf_counter()
            tree, _ = tier.restore(1, target)
            jax.block_until_ready(tree)
            return time.perf_counter() - t0

        def persist(which, step):
            tier = store.local if which == "local" else store.durable
            t0 = time.perf_counter()
            tier.put(step, state)
            tier.flush()
            return time.perf_counter() - t0

        order = list(times)
        restore("local"), restore("durable_warm")  # first touch of fresh memory, unrecorded
        for r in range(args.repeats):
            for which in order[r % 3:] + order[:r % 3]:
                times[which].append(restore(which))
            for which in (["local", "durable"] if r % 2 else ["durable", "local"]):
                writes[which].append(persist(which, 2 + r))
        store.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    report = {"gib": nbytes / GIB, "persist_both_tiers_s": persist_s, "machine": platform.platform(),
              "cpus": os.cpu_count(), "repeats": args.repeats,
              "restore": {k: {"median_s": statistics.median(v), "gib_per_s": nbytes / GIB / statistics.median(v),
                              "all_s": v} for k, v in times.items()}}
    report["persist"] = {k: {"median_s": statistics.median(v), "gib_per_s": nbytes / GIB / statistics.median(v),
                             "all_s": v} for k, v in writes.items()}
    for what in ("persist", "restore"):
        for k, v in report[what].items():
            print(f"{what} {k:13} {v['median_s'] * 1e3:8.1f} ms  {v['gib_per_s']:6.2f} GiB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
