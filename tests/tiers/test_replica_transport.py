"""The peer replicas' bulk transport (overlap_ckpt.tiers.transport): a message's bytes go
from the sender's transfer server to the receiver, not through the key-value store.

In one process (two or three Channels over a dict standing in for the key-value store,
pulling from this process's own transfer server over 127.0.0.1): bytes arrive bitwise, a
damaged transfer is refused, a pull from a server nobody runs fails within its bound and
names the process, and a process whose server cannot start falls back to the key-value
store, saying so. Between real processes (jax.distributed + gloo on 127.0.0.1,
tests/tiers/transport_worker.py): a ring of messages arrives bitwise with only small values
through the store, and a sender that dies before its message is pulled does not hang the
receiver.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time

import numpy as np
import pytest

from overlap_ckpt.tiers import peers
from overlap_ckpt.tiers import transport as replica_transport
from overlap_ckpt.storage import CheckpointError

from e2e.test_multiprocess import free_port, run_processes
from overlap_ckpt.storage.location import LocalLocation
from tiers.test_peers import FakeKeyValueStore, files, written  # noqa: F401 - a fixture

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transport_worker.py")
SMALL = 2048  # the largest value a bulk message may put in the key-value store (heads, acks)


class RecordingStore(FakeKeyValueStore):
    """The dict store, recording the size of every value set."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def key_value_set(self, key, value, allow_overwrite=False):
        self.sizes.append(len(value))
        super().key_value_set(key, value, allow_overwrite)

    key_value_set_bytes = key_value_set


def random_bytes(size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def deliver(sender, receivers, key, data):
    """Send ``data`` from ``sender`` to each of ``receivers``; every receiver's bytes."""
    sender.send(key, data, [r._me for r in receivers], step=3)
    got = []
    for receiver in receivers:
        head, bytes_ = receiver.receive(key, 1000)
        got.append(bytes_)
        receiver.ack(key)
        assert "bulk" in head and "parts" not in head  # peer to peer
    assert sender.wait_acks(key, [r._me for r in receivers], timeout_s=10) == {r._me: "" for r in receivers}
    return got


def test_bytes_arrive_bitwise_and_only_small_values_go_through_the_store(monkeypatch):
    monkeypatch.setattr(replica_transport, "CHUNK_BYTES", 1 << 20)  # several chunks, quickly
    kv = RecordingStore()
    sender = peers.Channel(kv, "ns", 0)
    receivers = [peers.Channel(kv, "ns", 1), peers.Channel(kv, "ns", 2)]  # replicas=2: one pull each
    rng = np.random.default_rng(55)
    sizes = [0, 1, 4097, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + int(rng.integers(1, 1 << 20))]
    sizes += [int(s) for s in rng.integers(0, 4 << 20, 3)]
    for n, size in enumerate(sizes):
        data = random_bytes(size, seed=n)
        assert deliver(sender, receivers, f"m{n}", data) == [data, data], size
    assert max(kv.sizes) < SMALL, max(kv.sizes)
    assert sender._bulk._offers == {}  # released once acknowledged
    assert set(kv.values) == {"ns/bulk/0", "ns/bulk/1", "ns/bulk/2"}


def test_a_damaged_transfer_is_refused(monkeypatch):
    kv = FakeKeyValueStore()
    sender, receiver = peers.Channel(kv, "ns", 0), peers.Channel(kv, "ns", 1)
    to_arrays = replica_transport._to_arrays

    def flip_one_byte(data, device):
        damaged = bytearray(data)
        damaged[len(damaged) // 2] ^= 0x10
        return to_arrays(bytes(damaged), device)

    monkeypatch.setattr(replica_transport, "_to_arrays", flip_one_byte)
    sender.send("m", random_bytes(100_000), [1], step=3)
    with pytest.raises(CheckpointError, match=r"the bytes of 'm' from process 0 arrived damaged"):
        receiver.receive("m", 1000)


def test_an_archive_received_in_chunks_installs_as_one_in_one_piece(written, tmp_path):
    """A received archive stays in the buffers it arrived in (Chunks); tarfile reads it
    across their boundaries, headers and files split anywhere."""
    own, _ = written
    archive = peers.pack(own, 4)
    cuts = [0, 1, 511, 513, 2000, len(archive) // 2, len(archive) - 3, len(archive)]
    chunks = replica_transport.Chunks([archive[a:b] for a, b in zip(cuts, cuts[1:])])
    assert len(chunks) == len(archive) and chunks == archive and bytes(chunks) == archive
    assert chunks != archive[:-1] + b"X"
    peers.install(LocalLocation(tmp_path / "whole"), 4, archive)
    peers.install(LocalLocation(tmp_path / "chunked"), 4, chunks)
    chunked, whole = files(tmp_path / "chunked" / "4"), files(tmp_path / "whole" / "4")
    assert chunked.pop("commit_success.txt") and whole.pop("commit_success.txt")  # names its directory
    assert chunked == whole
    assert peers.intact_steps(LocalLocation(tmp_path / "chunked"), [4], "default", peers.writer_tag(1, 2)) == [4]


def unused_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_pull_from_a_server_that_is_gone_fails_within_its_bound(monkeypatch):
    """jax retries a connection that is refused forever: the watchdog ends the pull."""
    monkeypatch.setattr(peers, "TIMEOUT_S", 2.0)
    kv = FakeKeyValueStore()
    sender, receiver = peers.Channel(kv, "ns", 0), peers.Channel(kv, "ns", 1)
    sender.send("m", random_bytes(1000), [1], step=3)
    receiver._bulk._addresses[0] = unused_address()  # process 0's server is gone
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"offered by process 0 .* did not arrive within 2 s: is process 0 alive"):
        receiver.receive("m", 1000)
    assert time.monotonic() - start < 10


def test_a_process_without_a_transfer_server_uses_the_store_and_says_so(monkeypatch, caplog):
    def cannot_start():
        raise RuntimeError("no CPU backend here")

    kv = RecordingStore()
    sender = peers.Channel(kv, "ns", 0)  # this process's server runs
    with monkeypatch.context() as m:
        m.setattr(replica_transport, "_started", {})
        m.setattr(replica_transport, "_start_server", cannot_start)
        with caplog.at_level(logging.WARNING, logger="overlap_ckpt.tiers.transport"):
            receiver = peers.Channel(kv, "ns", 1)  # "another process", whose server cannot start
    assert "could not start (RuntimeError: no CPU backend here)" in caplog.text
    assert kv.values["ns/bulk/1"] == ""
    data = random_bytes(300)
    with caplog.at_level(logging.WARNING, logger="overlap_ckpt.tiers.transport"):
        sender.send("m", data, [1], step=3)
    assert "process 1 has no replica transfer server" in caplog.text
    head, got = receiver.receive("m", 1000)
    assert got == data and head["parts"] == 1 and "bulk" not in head
    assert max(kv.sizes) == 300  # the bytes went through the store


def job(tmp_path, name, *extra, nprocs=2):
    port = free_port()
    cmds = [[sys.executable, WORKER, "--pid", str(pid), "--nprocs", str(nprocs), "--port", str(port), *extra]
            for pid in range(nprocs)]
    return [(code, log, [json.loads(line) for line in log.splitlines() if line.startswith('{"ev"')])
            for code, log in run_processes(cmds, tmp_path, name, devices=1)]


def test_two_processes_exchange_bytes_bitwise_with_no_bulk_bytes_through_the_store(tmp_path):
    sizes = [0, 1, 4097, replica_transport.CHUNK_BYTES + 12345]
    results = job(tmp_path, "ring", "--mode", "ring", "--sizes", ",".join(map(str, sizes)))
    for pid, (code, log, events) in enumerate(results):
        assert code == 0, log[-4000:]
        messages = [e for e in events if e["ev"] == "message"]
        assert [m["size"] for m in messages] == sizes
        assert all(m["intact"] and m["bulk"] and m["answers"] == {str((pid + 1) % 2): ""} for m in messages)
        done = next(e for e in events if e["ev"] == "done")
        assert done["kv_largest"] < SMALL and done["kv_total"] < 20 * SMALL, done  # 64 MiB went peer to peer


def test_a_sender_that_dies_does_not_hang_its_receiver(tmp_path):
    results = job(tmp_path, "dies", "--mode", "sender-dies", "--timeout", "3")
    code, log, events = results[0]
    assert code == 0, log[-4000:]
    refused = next((e for e in events if e["ev"] == "refused"), None)
    assert refused is not None, log[-4000:]
    assert "offered by process 1" in refused["error"] and "did not arrive within 3 s" in refused["error"]
    assert refused["waited_s"] < 10
    assert results[1][0] == -9  # it did die (SIGKILL)
