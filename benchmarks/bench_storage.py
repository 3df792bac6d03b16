"""Storage throughput: our persist/restore vs stock Orbax vs a raw sequential write.

Run from the repository root::

    python -m benchmarks.bench_storage --gib 1 --json benchmarks/results/storage.json
    python -m benchmarks.bench_storage --gib 0.05          # smoke test

One run builds a random float32 state of ``--gib`` GiB split into a transformer-like tree
(embedding + per-layer attention/MLP matrices + norm vectors, ~100 leaves) and measures,
each ``--repeats`` times in interleaved order on the same filesystem (``--dir``):

* ``raw_write``      the same bytes written sequentially to one file, fsync'd (dd-like);
* ``raw_write_parallel`` the same bytes as 4 files written by 4 threads, each fsync'd;
* ``ours_persist``   ``CheckpointStore.save`` + ``wait_until_finished`` (commit included);
* ``orbax_save``     ``ocp.StandardCheckpointer().save`` + ``wait_until_finished`` (sync);
* ``ours_restore``   ``CheckpointStore.restore(target=...)`` onto a CPU sharding;
* ``orbax_restore``  ``StandardCheckpointer().restore(path, abstract_tree)``;
* ``raw_read_cold``  the raw file read back sequentially from disk (the cold-restore ceiling).

Each round runs every measurement once (after an ``os.sync()``), in an order rotated from
round to round, after ``--warmup`` unrecorded rounds (on VMs the first touch of fresh page-cache/heap memory is
several times slower than later ones, which would penalize whoever runs first).

With ``--beside-training MODEL`` a background thread of the same process trains that
language model (``LMConfig.preset``, batch 2, AdamW, a sync every step as in
``benchmarks.run``) during every measurement, raw writes included: the persist-vs-raw ratio
then compares what the disk reaches beside training with what a plain write reaches beside
the same training (on a 2-core machine training takes the CPU that checksumming and the
kernel's page-cache copies need). Without it, CPU seconds per GiB of each write are
reported too (the cost that competes with training).

Each persist is also split into phases by the store's stage hooks (:func:`persist_phases`),
so that the report tells the disk-bound part (the data phase, against the raw write) from the
fixed cost each checkpoint pays whatever its size.

Restores are measured "warm" (files in the page cache, as right after a save) and, with
``--cold`` (default on), after evicting every checkpoint file from the page cache with
``posix_fadvise(DONTNEED)`` (no root needed), so that reads come from the device.
Reported numbers are medians over repeats (GiB/s = 2**30 bytes per second).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

GIB = 2**30


def make_state(gib: float, n_layers: int, seed: int = 0) -> dict[str, Any]:
    """A transformer-shaped float32 tree of about ``gib`` GiB (10 leaves per layer + 2)."""
    params = gib * GIB / 4
    d = max(8, int(math.sqrt(params / (12 * n_layers + 8)) // 8 * 8))
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    layers = {}
    for i in range(n_layers):
        layers[f"layer_{i:02d}"] = {
            "attn": {"q": rand(d, d), "k": rand(d, d), "v": rand(d, d), "o": rand(d, d)},
            "mlp": {"up": rand(d, 4 * d), "down": rand(4 * d, d)},
            "ln1": {"scale": rand(d), "bias": rand(d)},
            "ln2": {"scale": rand(d), "bias": rand(d)},
        }
    return {"embed": rand(8 * d, d), "layers": layers, "final_norm": rand(d)}


def leaves_of(tree) -> list[np.ndarray]:
    import jax

    return jax.tree_util.tree_leaves(tree)


def drop_cache(path: str) -> None:
    """Evict the file ``path``, or every file under the directory ``path``, from the page
    cache (they are clean: fsync'd). A file is named itself: ``os.walk`` of a file yields
    nothing, and the raw read's file was left in the cache before this (its "cold" reads
    ran at page-cache speed, 3.4-4.0 GiB/s, against ~1 GiB/s from this VM's disk)."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(dirpath, name) for dirpath, _dirs, names in os.walk(path) for name in names]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: str, arrays: list[np.ndarray]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in arrays:
            view = memoryview(np.ascontiguousarray(a)).cast("B")
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_parallel(directory: str, arrays: list[np.ndarray], writers: int = 4) -> None:
    """The same bytes as ``writers`` files written and fsync'd by concurrent threads: the
    best a multi-file writer (like ours, which writes several OCDBT data files at once)
    can expect from this filesystem."""
    from concurrent.futures import ThreadPoolExecutor

    groups = [arrays[i::writers] for i in range(writers)]
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(lambda ig: raw_write(os.path.join(directory, f"raw_{ig[0]}.bin"), ig[1]),
                      enumerate(groups)))


def raw_read(path: str, nbytes: int) -> np.ndarray:
    """Sequential read of ``path`` into a fresh buffer (64 MiB reads)."""
    out = np.empty(nbytes, np.uint8)
    view, done = memoryview(out), 0
    with open(path, "rb", buffering=0) as f:
        while done < nbytes:
            n = f.readinto(view[done:done + (64 << 20)])
            if not n:
                break
            done += n
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (TensorStore's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


PHASES = ("queue", "setup", "data", "tail")


def persist_phases(saved_at: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds of one persist by phase, from the first time each storage stage fired
    (``overlap_ckpt.storage.hooks``) and ``saved_at``, when ``save`` was called:

    * ``queue``: to the writer thread starting the step;
    * ``setup``: to the first array's writes being issued (leftovers removed, directories made,
      every array opened: a cost per leaf, not per byte);
    * ``data``: to every byte durable (TensorStore writes and fsyncs the data files; the
      metadata files are written meanwhile);
    * ``tail``: to the step being committed (merge of the B-trees, marker, fsyncs, rename).
    """
    order = [saved_at] + [marks[stage] for stage in ("start", "array_write", "data_written", "committed")]
    return {name: end - begin for name, begin, end in zip(PHASES, order, order[1:])}


class PhaseMarks:
    """Records when each storage stage first fires during one persist (a hook that injects no
    fault: :func:`overlap_ckpt.storage.set_fault_hook`), read off ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.marks: dict[str, float] = {}
        self._clock = clock

    def __call__(self, stage: str, info: dict) -> None:
        self.marks.setdefault(stage, self._clock())


class TrainingLoad:
    """Trains a preset language model in a daemon thread until stopped: the CPU competition
    a checkpoint writer meets beside training, applied equally to every measurement."""

    def __init__(self, model: str, batch_size: int = 2):
        import functools

        import jax
        import optax

        import overlap_ckpt as oc
        from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, TransformerLM, linen_init, linen_loss_fn

        config = LMConfig.preset(model)
        tokens = SyntheticTokens(config.vocab_size, config.seq_len, batch_size, seed=0).batch(0)["tokens"]
        self._batch = {"tokens": jax.device_put(tokens)}
        self._state = oc.TrainState.create(apply_fn=TransformerLM(config).apply,
                                           params=linen_init(config, 0), tx=optax.adamw(1e-3))

        @functools.partial(jax.jit, donate_argnums=0)
        def step(state, batch):
            loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
            return state.apply_gradients(grads=grads), loss

        self._step = step
        self._stop = threading.Event()
        self.steps = 0
        self._run_one()  # compile before any measurement
        self._thread = threading.Thread(target=self._loop, name="training-load", daemon=True)
        self._thread.start()

    def _run_one(self) -> None:
        import jax

        self._state, loss = self._step(self._state, self._batch)
        jax.block_until_ready(loss)
        self.steps += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._run_one()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    ap.add_argument("--layers", type=int, default=10, help="layers of the tree (10 leaves each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before measuring")
    ap.add_argument("--dir", default=None,
                    help="parent directory for the files (default: the system temp dir)")
    ap.add_argument("--json", default=None, help="write the results as JSON to this path")
    ap.add_argument("--no-orbax", action="store_true", help="skip the Orbax measurements")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache restores")
    ap.add_argument("--chunk-mib", type=float, default=None, help="CheckpointStore chunk_bytes (MiB)")
    ap.add_argument("--no-checksums", action="store_true",
                    help="CheckpointStore(checksums=False): chunks without crc32c, as Orbax writes them")
    ap.add_argument("--beside-training", metavar="MODEL", default=None,
                    help="train this LMConfig preset (e.g. 20m) in a background thread throughout")
    args = ap.parse_args(argv)

    import jax
    import orbax.checkpoint as ocp

    from overlap_ckpt.storage import CheckpointStore, set_fault_hook

    parent = os.path.abspath(args.dir or tempfile.gettempdir())
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench_", dir=parent)
    state = make_state(args.gib, args.layers)
    arrays = leaves_of(state)
    nbytes = sum(a.nbytes for a in arrays)
    gib = nbytes / GIB
    cpu = jax.devices("cpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(cpu)
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), state)
    jax_state = None if args.no_orbax else jax.device_put(state, cpu)
    store_kw = {}
    if args.chunk_mib:
        store_kw["chunk_bytes"] = int(args.chunk_mib * 2**20)
    if args.no_checksums:
        store_kw["checksums"] = False
    print(f"state: {gib:.3f} GiB in {len(arrays)} leaves; files under {work}", flush=True)

    runs: dict[str, list[float]] = {k: [] for k in (
        "raw_write", "raw_write_parallel", "ours_persist", "orbax_save", "ours_restore_warm", "orbax_restore_warm",
        "ours_restore_cold", "orbax_restore_cold", "raw_read_cold")}
    cpu_per_gib: dict[str, list[float]] = {}  # writes only, and only without a training load
    phases: dict[str, list[float]] = {name: [] for name in PHASES}  # ours_persist, seconds

    def rate(key, seconds):
        runs[key].append(gib / seconds)

    checked = False
    ckptr = None if args.no_orbax else ocp.StandardCheckpointer()

    def one_round(r: int, record: bool) -> None:
        """All measurements once, in an order rotated by ``r`` (spreads order effects)."""
        nonlocal checked
        ours_dir, orbax_dir = os.path.join(work, f"ours_{r}"), os.path.join(work, f"orbax_{r}")
        raw_path = os.path.join(work, "raw.bin")
        store = CheckpointStore(ours_dir, **store_kw)

        def persist():
            clock = PhaseMarks()
            previous = set_fault_hook(clock)
            try:
                saved_at = time.perf_counter()
                store.save(1, state)
                store.wait_until_finished()
            finally:
                set_fault_hook(previous)
            if record:
                for name, seconds in persist_phases(saved_at, clock.marks).items():
                    phases[name].append(seconds)

        def orbax_save():
            ckptr.save(orbax_dir, jax_state)
            ckptr.wait_until_finished()

        raw_dir = os.path.join(work, "raw_parallel")
        os.makedirs(raw_dir, exist_ok=True)
        writes = [("raw_write", lambda: raw_write(raw_path, arrays)), ("ours_persist", persist),
                  ("raw_write_parallel", lambda: raw_write_parallel(raw_dir, arrays))]
        if ckptr is not None:
            writes.append(("orbax_save", orbax_save))
        for key, fn in writes[r % len(writes):] + writes[:r % len(writes)]:
            os.sync()  # no writeback left over from the previous measurement
            cpu0 = cpu_seconds()
            seconds = timed(fn)[0]
            if record:
                rate(key, seconds)
                if load is None:
                    cpu_per_gib.setdefault(key, []).append((cpu_seconds() - cpu0) / gib)
        shutil.rmtree(raw_dir)

        def ours_restore():
            restored, _ = store.restore(1, abstract)
            return jax.block_until_ready(restored)

        def orbax_restore():
            return jax.block_until_ready(ckptr.restore(orbax_dir, abstract))

        reads = [("ours", ours_dir, ours_restore)]
        if ckptr is not None:
            reads.append(("orbax", orbax_dir, orbax_restore))
        for temp in ("warm",) if args.no_cold else ("warm", "cold"):
            for who, path, fn in reads[r % len(reads):] + reads[:r % len(reads)]:
                os.sync()
                if temp == "cold":
                    drop_cache(path)
                seconds, restored = timed(fn)
                if record:
                    rate(f"{who}_restore_{temp}", seconds)
                if who == "ours" and not checked:
                    for a, b in zip(arrays, leaves_of(restored)):
                        assert np.array_equal(a, np.asarray(b)), "restore is not bitwise equal"
                    checked = True
                del restored
        if not args.no_cold:  # the disk's own read speed: the ceiling of any cold restore
            os.sync()
            drop_cache(raw_path)
            seconds = timed(lambda: raw_read(raw_path, nbytes))[0]
            if record:
                rate("raw_read_cold", seconds)
        os.unlink(raw_path)
        store.close()
        shutil.rmtree(ours_dir)
        shutil.rmtree(orbax_dir, ignore_errors=True)

    load = TrainingLoad(args.beside_training) if args.beside_training else None
    started = time.perf_counter()
    try:
        for r in range(args.warmup):
            one_round(r, record=False)  # first touches of page cache / heap are slow on VMs
        for r in range(args.repeats):
            one_round(r, record=True)
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
                f"{k}={v[-1]:.2f}" for k, v in runs.items() if len(v) > r), flush=True)
    finally:
        if load is not None:
            load.stop()
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in runs.items() if v}
    ratios = {}
    if "raw_write" in med:
        ratios["persist_vs_raw"] = med["ours_persist"] / med["raw_write"]
        ratios["persist_vs_raw_parallel"] = med["ours_persist"] / med["raw_write_parallel"]
    if "orbax_save" in med:
        ratios["persist_vs_orbax_save"] = med["ours_persist"] / med["orbax_save"]
    if "raw_read_cold" in med:
        ratios["restore_cold_vs_raw_read"] = med["ours_restore_cold"] / med["raw_read_cold"]
    for temp in ("warm", "cold"):
        if f"orbax_restore_{temp}" in med:
            ratios[f"restore_{temp}_vs_orbax"] = med[f"ours_restore_{temp}"] / med[f"orbax_restore_{temp}"]

    rows = [("raw sequential write (fsync)", "raw_write", None),
            ("raw write, 4 files in parallel (fsync)", "raw_write_parallel", None),
            ("ours: persist (save+wait, committed)", "ours_persist", "persist_vs_raw"),
            ("orbax: StandardCheckpointer sync save", "orbax_save", None),
            ("ours: restore, warm cache", "ours_restore_warm", "restore_warm_vs_orbax"),
            ("orbax: restore, warm cache", "orbax_restore_warm", None),
            ("ours: restore, cold cache", "ours_restore_cold", "restore_cold_vs_orbax"),
            ("orbax: restore, cold cache", "orbax_restore_cold", None),
            ("raw sequential read, cold cache", "raw_read_cold", None)]
    print(f"\n{'measurement':42s} {'GiB/s (median)':>15s} {'min..max':>14s}  ratio")
    for label, key, ratio in rows:
        if key not in med:
            continue
        ratio_txt = ""
        if ratio in ratios:
            ratio_txt = f"{ratios[ratio]:.2f}x {'raw' if ratio == 'persist_vs_raw' else 'orbax'}"
        print(f"{label:42s} {med[key]:15.2f} {min(runs[key]):6.2f}..{max(runs[key]):<6.2f}  {ratio_txt}")
    print(f"{'(ours persist vs raw parallel write)':42s} {'':15s} {'':14s}  "
          f"{ratios['persist_vs_raw_parallel']:.2f}x raw-parallel")
    if "restore_cold_vs_raw_read" in ratios:
        print(f"{'(ours cold restore vs raw cold read)':42s} {'':15s} {'':14s}  "
              f"{ratios['restore_cold_vs_raw_read']:.2f}x raw-read")
    if "persist_vs_orbax_save" in ratios:
        print(f"{'(ours persist vs orbax save)':42s} {'':15s} {'':14s}  {ratios['persist_vs_orbax_save']:.2f}x orbax")
    # The same ratio per round (both writes a few seconds apart): less exposed to drifting load.
    ratios["persist_vs_raw_paired"] = statistics.median(
        ours / raw for ours, raw in zip(runs["ours_persist"], runs["raw_write"]))
    print(f"{'(ours persist vs raw, median of rounds)':42s} {'':15s} {'':14s}  "
          f"{ratios['persist_vs_raw_paired']:.2f}x raw")
    phase_med = {name: statistics.median(v) for name, v in phases.items()}
    ratios["persist_data_phase_vs_raw"] = gib / phase_med["data"] / med["raw_write"]
    print("ours persist by phase (median ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phase_med.items())
          + f"; the data phase alone {gib / phase_med['data']:.2f} GiB/s = "
          f"{ratios['persist_data_phase_vs_raw']:.2f}x raw")
    cpu_med = {k: statistics.median(v) for k, v in cpu_per_gib.items()}
    if cpu_med:
        print("CPU seconds per GiB written: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu_med.items()))
    training = None
    if load is not None:
        training = {"model": args.beside_training, "steps": load.steps,
                    "steps_per_s": load.steps / (time.perf_counter() - started)}
        print(f"beside training {args.beside_training}: {training['steps_per_s']:.2f} steps/s throughout")

    result = {
        "benchmark": "storage",
        "state_bytes": nbytes, "state_gib": gib, "leaves": len(arrays), "repeats": args.repeats,
        "warmup": args.warmup, "store_options": {k: v for k, v in store_kw.items()},
        "filesystem_dir": parent,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "runs_gibps": runs, "median_gibps": med, "ratios": ratios, "cpu_s_per_gib": cpu_med,
        "persist_phases_s": phases,
        "beside_training": training,
        "targets": {"persist_vs_raw": 0.9, "restore_vs_orbax": 2.0},
        "notes": "orbax restores and ours go to the same CPU sharding; cold = page cache evicted "
                 "with posix_fadvise(DONTNEED) before the restore.",
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
