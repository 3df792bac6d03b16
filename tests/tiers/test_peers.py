"""Peer replicas, one process: a local step copied byte for byte into a replica directory
is listed only when whole, and the key-value channel delivers bytes intact or refuses them.

The transport between real processes (jax.distributed) is exercised by
tests/tiers/test_multiprocess.py and tests/tiers/test_replica_transport.py; here a dict stands
in for the coordination service's key-value store, to check the parts, digest and
acknowledgement logic on its own.
"""

from __future__ import annotations

import io
import os
import tarfile
import time

import numpy as np
import pytest

from overlap_ckpt.tiers import peers
from overlap_ckpt.storage import CheckpointError, CheckpointStore, SingleProcess, commit
from overlap_ckpt.storage.location import LocalLocation

TAG = peers.writer_tag(1, 2)


def files(root):
    return {os.path.relpath(os.path.join(d, n), root): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(root) for n in names}


@pytest.fixture
def written(tmp_path):
    """Step 4 of process 1's local tier (a small tree, tagged as the local tier tags it)."""
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int32(4)}
    with CheckpointStore(tmp_path / "own", coordinator=SingleProcess()) as store:
        store.put(4, tree, {peers.TIER_KEY: TAG})
        store.flush()
    return LocalLocation(tmp_path / "own"), tree


def test_a_replica_is_a_byte_copy_that_restores(written, tmp_path):
    own, tree = written
    held = LocalLocation(tmp_path / "held")
    peers.install(held, 4, peers.pack(own, 4))
    copied = files(tmp_path / "held" / "4")
    assert copied.pop(peers.SIZES) and copied.pop("commit_success.txt")
    original = files(tmp_path / "own" / "4")
    original.pop("commit_success.txt")
    assert copied == original
    assert peers.intact_steps(held, [4], "default", TAG) == [4]
    assert peers.intact_steps(held, [4], "default", peers.writer_tag(0, 2)) == []  # another writer's
    with CheckpointStore(tmp_path / "held", read_only=True) as store:
        restored, _ = store.restore(4)
    assert all(np.array_equal(restored[k], tree[k]) for k in tree)


def test_a_replica_sent_on_again_is_intact_where_it_lands(written, tmp_path):
    """A step packed from a replica directory (a process restored from its peer's replica,
    then its own copy sent on) carries the first install's size record: the second install
    records each file's size as it lands, its own record included, never the stale one."""
    own, _ = written
    first, second = LocalLocation(tmp_path / "first"), LocalLocation(tmp_path / "second")
    peers.install(first, 4, peers.pack(own, 4))
    peers.install(second, 4, peers.pack(first, 4))
    assert peers.intact_steps(second, [4], "default", TAG) == [4]


def test_a_truncated_or_uncommitted_replica_is_never_listed(written, tmp_path):
    own, _ = written
    held = LocalLocation(tmp_path / "held")
    peers.install(held, 4, peers.pack(own, 4))
    data = max((p for p in (tmp_path / "held" / "4").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 1)
    assert peers.intact_steps(held, [4], "default", TAG) == []
    peers.install(held, 4, peers.pack(own, 4))  # sent again: replaces the torn copy
    assert peers.intact_steps(held, [4], "default", TAG) == [4]
    os.rename(tmp_path / "held" / "4", tmp_path / "held" / "4.orbax-checkpoint-tmp-7")  # never committed
    assert commit.list_steps(held).complete == []


def test_an_archive_with_anything_but_that_step_is_refused(written, tmp_path):
    own, _ = written
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(own.path("4"), arcname="6")  # another step's name
    with pytest.raises(CheckpointError, match="not a file of step directory 4/"):
        peers.install(LocalLocation(tmp_path / "held"), 4, buffer.getvalue())
    assert not (tmp_path / "held" / "4").exists()


class FakeKeyValueStore:
    """The calls of jax.distributed's client that Channel makes, over a dict."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    key_value_set_bytes = key_value_set

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.values:
            time.sleep(min(timeout_ms, 1) / 1000)  # pollers (receivers, acknowledgements) do not spin
            raise RuntimeError("DEADLINE_EXCEEDED: no such key yet")
        return self.values[key]

    blocking_key_value_get_bytes = blocking_key_value_get

    def key_value_try_get(self, key):
        return self.blocking_key_value_get(key, 0)

    def key_value_delete(self, prefix):
        self.values = {k: v for k, v in self.values.items() if not k.startswith(prefix)}


def test_the_key_value_channel_delivers_in_parts_and_refuses_damaged_bytes(monkeypatch):
    """The key-value path (a process without a transfer server; bulk=False here)."""
    monkeypatch.setattr(peers, "_PART_BYTES", 10)
    kv = FakeKeyValueStore()
    sender, receiver = peers.Channel(kv, "ns", 0, bulk=False), peers.Channel(kv, "ns", 1, bulk=False)
    payload = bytes(range(45))
    sender.send("m", payload, [1], step=8)
    assert len([k for k in kv.values if "/part/" in k]) == 5
    head, data = receiver.receive("m", 10)
    assert data == payload and head["step"] == 8
    receiver.ack("m")
    assert sender.wait_acks("m", [1], timeout_s=1) == {1: ""}
    assert set(kv.values) == {"ns/bulk/0", "ns/bulk/1"}  # the message deleted once acknowledged

    sender.send("n", payload, [1], step=10)
    kv.values["ns/n/part/2"] = b"X" * 10  # damaged on the way
    with pytest.raises(CheckpointError, match="arrived damaged"):
        receiver.receive("n", 10)
    with pytest.raises(TimeoutError):
        receiver.receive("nothing", 10)

    receiver.close()  # a holder that closed is not waited for
    assert sender.wait_acks("n", [1], timeout_s=5) == {1: None}


def test_a_sender_that_fell_behind_sends_every_kept_step_newest_first(tmp_path):
    """Steps 12, 14 and 16 commit on process 0 before its sender looks (a slow sender, a
    busy machine): the holder ends with what process 0's local tier keeps (14 and 16), so
    that a restore can fall back to 14 when 16 is torn somewhere. 16 is sent first."""
    with CheckpointStore(tmp_path / "p0", coordinator=SingleProcess()) as store:
        for step in (12, 14, 16):
            store.put(step, {"w": np.full(4, step, np.float32)}, {peers.TIER_KEY: peers.writer_tag(0, 2)})
            store.flush()
    own = LocalLocation(tmp_path / "p0")
    kv = FakeKeyValueStore()
    sent = []
    channel_send = peers.Channel.send

    def record(channel, key, data, receivers, **fields):
        sent.append(fields["step"])
        channel_send(channel, key, data, receivers, **fields)

    def replicas(index, own_dir):
        return peers.PeerReplicas(kv, "ns", process_index=index, process_count=2, replicas=1, own_dir=own_dir,
                                  own_steps=lambda: (own, commit.list_steps(own).complete), item_name="default",
                                  max_to_keep=2)

    sender, holder = replicas(0, str(tmp_path / "p0")), replicas(1, str(tmp_path / "p1"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(peers.Channel, "send", record)
        holder.start()
        sender.start()
        sender.notify()  # one notification for three committed steps
        sender.flush()
        assert sender.take_errors() == []
        assert holder.held_steps() == {0: [14, 16]}
        assert sent == [16, 14]
        sender.notify()  # nothing new: nothing is sent again
        sender.flush()
        assert sent == [16, 14]
        sender.close()
        holder.close()
