"""One process of the replica transport's multi-process tests (jax.distributed + gloo on
127.0.0.1): :class:`overlap_ckpt.tiers.peers.Channel` between real processes, its bytes through
the transfer servers.

``--mode ring``: each process sends messages of ``--sizes`` bytes (seeded random bytes) to
the next process (mod N) and receives those of the previous one, checks them bitwise and
acknowledges. The key-value client is wrapped to record every value set or read.
``--mode sender-dies``: process 1 offers a message to process 0, then SIGKILLs itself
before process 0 pulls; process 0 must get a :class:`CheckpointError` naming process 1
within ``--timeout`` (``peers.TIMEOUT_S``), not hang.

stdout: JSON lines ``{"ev": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def emit(**fields) -> None:
    print(json.dumps({"ev": fields.pop("ev"), **fields}), flush=True)


def payload(source: int, n: int, size: int) -> bytes:
    import numpy as np
    return np.random.default_rng([source, n, size]).integers(0, 256, size, dtype=np.uint8).tobytes()


class RecordingClient:
    """jax.distributed's client, recording the size of every value that passes the store."""

    def __init__(self, client):
        self._client = client
        self.largest = 0
        self.total = 0

    def _record(self, value):
        size = len(value)
        self.largest, self.total = max(self.largest, size), self.total + size
        return value

    def key_value_set(self, key, value, allow_overwrite=False):
        self._record(value)
        return self._client.key_value_set(key, value, allow_overwrite=allow_overwrite)

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        self._record(value)
        return self._client.key_value_set_bytes(key, value, allow_overwrite=allow_overwrite)

    def blocking_key_value_get(self, key, timeout_ms):
        return self._record(self._client.blocking_key_value_get(key, timeout_ms))

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        return self._record(self._client.blocking_key_value_get_bytes(key, timeout_ms))

    def __getattr__(self, name):
        return getattr(self._client, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=("ring", "sender-dies"), required=True)
    ap.add_argument("--sizes", default="0,1,4097")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.nprocs,
                               process_id=args.pid, initialization_timeout=30, heartbeat_timeout_seconds=60)
    from overlap_ckpt.tiers import peers
    from overlap_ckpt.storage import CheckpointError
    from overlap_ckpt.storage.coordination import distributed_client

    peers.TIMEOUT_S = args.timeout
    raw = distributed_client()
    client = RecordingClient(raw)
    channel = peers.Channel(client, "transport_test", args.pid)
    emit(ev="address", pid=args.pid, address=channel._bulk.address)

    if args.mode == "ring":
        sizes = [int(s) for s in args.sizes.split(",")]
        after, before = (args.pid + 1) % args.nprocs, (args.pid - 1) % args.nprocs
        for n, size in enumerate(sizes):
            key_out, key_in = f"ring/{args.pid}/{n}", f"ring/{before}/{n}"
            channel.send(key_out, payload(args.pid, n, size), [after], n=n)
            head, data = channel.receive(key_in, 60_000)
            intact = data == payload(before, n, size)
            channel.ack(key_in, "" if intact else "not the bytes sent")
            answers = channel.wait_acks(key_out, [after], 60)
            emit(ev="message", pid=args.pid, size=size, intact=intact, bulk="bulk" in head, answers=answers)
        raw.wait_at_barrier("transport_worker:done", 60_000)
        emit(ev="done", pid=args.pid, kv_largest=client.largest, kv_total=client.total)
        return 0

    # sender-dies
    if args.pid == 1:
        channel.send("doomed", payload(1, 0, 1 << 20), [0])
        raw.key_value_set("transport_worker:dying", "")
        emit(ev="dying", pid=1)
        os.kill(os.getpid(), signal.SIGKILL)
    raw.blocking_key_value_get("transport_worker:dying", 30_000)
    time.sleep(1.0)  # process 1 is gone: its transfer server with it
    start = time.monotonic()
    try:
        channel.receive("doomed", 30_000)
    except CheckpointError as e:
        emit(ev="refused", pid=0, error=str(e), waited_s=time.monotonic() - start)
    else:
        emit(ev="received", pid=0, waited_s=time.monotonic() - start)
    sys.stdout.flush()
    os._exit(0)  # no shutdown barrier: process 1 will never reach it


if __name__ == "__main__":
    sys.exit(main())
