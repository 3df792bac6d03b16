"""Peer-replica throughput: the bulk transport (jax.experimental.transfer, peer to peer)
beside the key-value path (every byte through process 0), with a memcpy as the ceiling.

Run from the repository root::

    python -m benchmarks.bench_replicas --mib 256 --rounds 5 --out benchmarks/results/cpu_replica_transport
    python -m benchmarks.bench_replicas --mib 1 --rounds 1 --processes 2   # smoke test

One job of ``--processes`` processes on this machine (jax.distributed on 127.0.0.1, one CPU
device each) sends ``--mib`` MiB messages through :class:`overlap_ckpt.tiers.peers.Channel`, as
the peer replicas do (sha256 on both sides, head, pull, acknowledgement), once with the
bulk transport and once with ``bulk=False`` (the key-value store only), in the same
processes and rounds, the order of the two paths alternated each round. Per round:

* ``pair``: process 2 sends to process 1 (its ring holder), the others idle: neither is
  the coordinator, so the key-value path relays every byte through process 0;
* ``ring``: every process sends to its ring holder (process ``i`` to ``i-1``) at once and
  receives from ``i+1``: the aggregate is N messages over the time from the first send to
  the last acknowledgement;
* ``memcpy``: ``numpy.copyto`` of the same number of bytes in one process (the ceiling of
  one pair on this machine).

Time runs from the send (the archive already in memory: packing a step directory is not
timed) to the sender's last acknowledgement. Counted per phase: the bytes of values set in
and read from the key-value store by every process (all of them pass process 0's
coordination service) and the bytes process 0 itself sent or received as a peer.
Reported: MB/s (1e6 bytes/s) per phase and path, median and range over rounds, and the
per-round ratios bulk / key-value and bulk / memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.reporting import publish

PATHS = ("bulk", "kv")


class CountingClient:
    """jax.distributed's client, counting the bytes of every value set in or read from the store."""

    def __init__(self, client):
        self._client = client
        self.bytes = 0
        self._lock = threading.Lock()

    def _count(self, value):
        with self._lock:
            self.bytes += len(value)
        return value

    def key_value_set(self, key, value, allow_overwrite=False):
        self._count(value)
        return self._client.key_value_set(key, value, allow_overwrite=allow_overwrite)

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        self._count(value)
        return self._client.key_value_set_bytes(key, value, allow_overwrite=allow_overwrite)

    def blocking_key_value_get(self, key, timeout_ms):
        return self._count(self._client.blocking_key_value_get(key, timeout_ms))

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        return self._count(self._client.blocking_key_value_get_bytes(key, timeout_ms))

    def __getattr__(self, name):
        return getattr(self._client, name)


def worker(args) -> None:
    """One process of the job: prints one JSON line per phase and round."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
                               process_id=args.pid, initialization_timeout=60, heartbeat_timeout_seconds=600)
    import numpy as np

    from overlap_ckpt.tiers import peers
    from overlap_ckpt.storage.coordination import distributed_client

    raw = distributed_client()
    client = CountingClient(raw)
    channels = {"bulk": peers.Channel(client, "bench_replicas/bulk", args.pid),
                "kv": peers.Channel(client, "bench_replicas/kv", args.pid, bulk=False)}
    assert channels["bulk"]._bulk.address, "the transfer server did not start"
    me, n = args.pid, args.processes
    holder, source = (me - 1) % n, (me + 1) % n
    nbytes = int(args.mib * (1 << 20))
    data = np.random.default_rng(me).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    expected_from_source = np.random.default_rng(source).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    barriers = iter(range(1 << 30))
    timeout_ms = int(args.timeout * 1000)

    def barrier():
        raw.wait_at_barrier(f"bench_replicas:{next(barriers)}", timeout_ms)

    def emit(**fields):
        print(json.dumps({"pid": me, **fields}), flush=True)

    def exchange(path, name, send, receive):
        """Send to ``holder`` and/or receive from ``source`` on ``path``: times and bytes."""
        key, key_in = f"{name}/{me}", f"{name}/{source}"
        channel = channels[path]
        kv_before = client.bytes
        barrier()
        start = time.time()
        done = {}

        def sender():
            try:
                channel.send(key, data, [holder])
                answers = channel.wait_acks(key, [holder], timeout_ms / 1000)
                assert answers == {holder: ""}, answers
                done["send"] = time.time()
            except BaseException as e:  # noqa: BLE001 - raised by the main thread below
                done["error"] = e

        thread = threading.Thread(target=sender) if send else None
        if thread:
            thread.start()
        if receive:
            _, got = channel.receive(key_in, timeout_ms)  # its sha256 checked
            channel.ack(key_in)
            done["receive"] = time.time()
            assert got == expected_from_source  # bitwise, once more (untimed)
        if thread:
            thread.join()
            if "error" in done:
                raise done["error"]
        barrier()  # every process's counters include the whole phase
        return {"start": start, "end": done.get("send"), "kv_bytes": client.bytes - kv_before,
                "peer_bytes": nbytes * (bool(send) + bool(receive))}

    dst, src = np.empty(nbytes, np.uint8), np.frombuffer(data, np.uint8)
    np.copyto(dst, src)  # first touch, untimed
    for path in PATHS:  # warm up: connections, first pulls
        exchange(path, f"warm/{path}", send=me == 2 % n, receive=me == 1 % n)
    for r in range(args.rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            emit(round=r, phase="pair", path=path,
                 **exchange(path, f"pair/{r}/{path}", send=me == 2 % n, receive=me == 1 % n))
            emit(round=r, phase="ring", path=path, **exchange(path, f"ring/{r}/{path}", True, True))
        if me == 1 % n:
            start = time.time()
            np.copyto(dst, src)
            emit(round=r, phase="memcpy", path="memcpy", start=start, end=time.time(), kv_bytes=0, peer_bytes=0)
        barrier()
    jax.distributed.shutdown()  # together: process 0 runs the service the others still use


def summarize(rows: list[dict], args) -> dict:
    nbytes = int(args.mib * (1 << 20))
    by = {}
    for row in rows:
        by.setdefault((row["phase"], row["path"], row["round"]), []).append(row)
    rates, kv_bytes, peer0 = {}, {}, {}
    for (phase, path, r), group in sorted(by.items()):
        ends = [g["end"] for g in group if g["end"] is not None]
        start = min(g["start"] for g in group)
        messages = len(ends) if phase != "memcpy" else 1
        rates.setdefault(f"{phase}/{path}", []).append(messages * nbytes / (max(ends) - start) / 1e6)
        kv_bytes.setdefault(f"{phase}/{path}", []).append(sum(g["kv_bytes"] for g in group))
        peer0.setdefault(f"{phase}/{path}", []).append(sum(g["peer_bytes"] for g in group if g["pid"] == 0))

    def spread(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}

    ratios = {}
    for phase in ("pair", "ring"):
        bulk, kv = rates[f"{phase}/bulk"], rates[f"{phase}/kv"]
        ratios[f"{phase}: bulk / kv"] = spread([b / k for b, k in zip(bulk, kv)])
        ratios[f"{phase}: bulk / memcpy"] = spread([b / m for b, m in zip(bulk, rates["memcpy/memcpy"])])
    return {"benchmark": "bench_replicas", "mib": args.mib, "rounds": args.rounds, "processes": args.processes,
            "machine": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_end": list(os.getloadavg()),
            "mb_per_s": {k: spread(v) for k, v in rates.items()}, "ratios": ratios,
            "kv_store_bytes_per_phase": {k: spread(v) for k, v in kv_bytes.items()},
            "process0_peer_bytes_per_phase": {k: spread(v) for k, v in peer0.items()}}


def markdown(report: dict, argv: list[str]) -> str:
    mib, n = report["mib"], report["processes"]
    rate, kv, p0 = report["mb_per_s"], report["kv_store_bytes_per_phase"], report["process0_peer_bytes_per_phase"]

    def fmt(s, digits=0):
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    def size(s):
        b = s["median"]
        return f"{b / (1 << 20):.1f} MiB" if b >= 1 << 20 else f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b:.0f} B"

    pair = f"pair ({2 % n} -> {1 % n})"
    names = {"pair/bulk": f"{pair}, bulk transport", "pair/kv": f"{pair}, key-value store",
             "ring/bulk": f"ring of {n} (aggregate), bulk transport",
             "ring/kv": f"ring of {n} (aggregate), key-value store", "memcpy/memcpy": "numpy memcpy, one process"}
    lines = [f"# Peer-replica transport: {mib:g} MiB per message, {n} processes on this machine, "
             f"{report['rounds']} rounds", "",
             f"`python -m benchmarks.bench_replicas {' '.join(argv)}`", "",
             f"Machine: {report['machine']}, {report['cpus']} CPUs, load average at the end "
             f"{report['loadavg_at_end'][0]:.1f}. Median (min-max) over rounds.", "",
             "| phase, path | MB/s | bytes through the key-value store (all via process 0) "
             "| bytes process 0 sent or received as a peer |", "|---|--:|--:|--:|"]
    for key, name in names.items():
        lines.append(f"| {name} | {fmt(rate[key])} | {size(kv[key]) if key != 'memcpy/memcpy' else '-'} "
                     f"| {size(p0[key]) if key != 'memcpy/memcpy' else '-'} |")
    lines += ["", "| ratio (paired by round) | median (min-max) |", "|---|--:|"]
    lines += [f"| {k} | {fmt(v, 2)} |" for k, v in report["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--out", default=None, help="output prefix: <out>.json and <out>.md")
    ap.add_argument("--timeout", type=float, default=3600, help="the whole job, seconds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return None
    if args.processes < 2:
        ap.error("--processes must be at least 2")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""), "TF_CPP_MIN_LOG_LEVEL": "2"}
    common = ["--mib", str(args.mib), "--rounds", str(args.rounds), "--processes", str(args.processes),
              "--port", str(port), "--timeout", str(args.timeout), "--worker"]
    logs = [tempfile.TemporaryFile("w+") for _ in range(args.processes)]  # not pipes: none may fill up
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_replicas", *common, "--pid", str(pid)],
                              cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
             for pid, log in enumerate(logs)]
    outputs = []
    deadline = time.monotonic() + args.timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            outputs.append(log.read())
            log.close()
    for proc, out in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"a benchmark process failed ({proc.returncode}):\n{out[-4000:]}")
    rows = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith('{"pid"')]
    report = summarize(rows, args)
    publish(report, markdown(report, argv if argv is not None else sys.argv[1:]), args.out)
    return report


if __name__ == "__main__":
    main()
