"""Retention and the PCcheck-style queue of host copies."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_ckpt.storage import CheckpointStore, set_fault_hook
from overlap_ckpt.storage.retention import steps_to_delete


# -- retention -------------------------------------------------------------------------------

def test_retention_rules():
    assert steps_to_delete([1, 2, 3], max_to_keep=None, keep_every_n_steps=None) == []
    assert steps_to_delete([1, 2, 3, 4], max_to_keep=2, keep_every_n_steps=None) == [1, 2]
    assert steps_to_delete(range(1, 11), max_to_keep=2, keep_every_n_steps=4) == [1, 2, 3, 5, 6, 7]
    assert steps_to_delete([5, 6], max_to_keep=1, keep_every_n_steps=None, protected={5}) == []


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 200), min_size=1, max_size=30), st.integers(1, 6),
       st.one_of(st.none(), st.integers(1, 10)))
def test_retention_properties(steps, keep, every):
    doomed = steps_to_delete(steps, max_to_keep=keep, keep_every_n_steps=every)
    kept = set(steps) - set(doomed)
    assert max(steps) in kept
    assert set(sorted(steps)[-keep:]) <= kept
    if every:
        assert {s for s in steps if s % every == 0} <= kept
    assert len(kept) >= min(keep, len(steps))


def test_retention_in_store(tmp_path):
    with CheckpointStore(tmp_path, max_to_keep=2, keep_every_n_steps=3) as store:
        for step in range(1, 8):
            store.save(step, {"a": np.full(4, step, np.float32)})
            store.wait_until_finished()
        assert store.all_steps() == [3, 6, 7]
    # A new manager applies the policy to steps written by an earlier one.
    with CheckpointStore(tmp_path, max_to_keep=1) as store:
        store.save(8, {"a": np.zeros(4, np.float32)})
        store.wait_until_finished()
        assert store.all_steps() == [8]


# -- PCcheck queue -----------------------------------------------------------------------------

@pytest.fixture
def stalled():
    """A hook that holds the persist of step 1 until ``gate`` is set; ``released`` tells that
    it let go, ``events`` is the order of storage stages and of the test's own marks."""
    stall = types.SimpleNamespace(gate=threading.Event(), started=threading.Event(),
                                  released=threading.Event(), events=[])

    def hook(stage, info):
        stall.events.append((stage, info["step"]))
        if stage == "start" and info["step"] == 1:
            stall.started.set()
            stall.gate.wait(30)
            stall.released.set()

    previous = set_fault_hook(hook)
    yield stall
    stall.gate.set()
    set_fault_hook(previous)


def state(step):
    return {"w": np.full((32, 32), step, np.float32)}


def test_drop_oldest_unstarted_instead_of_blocking(tmp_path, stalled, caplog):
    gate, started = stalled.gate, stalled.started
    with CheckpointStore(tmp_path, max_pending_host_copies=2) as store:
        store.save(1, state(1))
        assert started.wait(10)
        for step in (2, 3, 4):
            store.save(step, state(step))
        assert not stalled.released.is_set()  # never blocked training: step 1 is still held
        assert store.pending_steps() == [1, 4]  # in flight + newest queued = 2 host copies
        assert store.dropped_steps == [2, 3]
        assert "dropped before it started" in caplog.text
        gate.set()
        store.wait_until_finished()
        assert store.all_steps() == [1, 4]


def test_single_host_copy_drops_the_new_save(tmp_path, stalled):
    gate, started = stalled.gate, stalled.started
    with CheckpointStore(tmp_path, max_pending_host_copies=1) as store:
        store.save(1, state(1))
        assert started.wait(10)
        store.save(2, state(2))
        assert store.dropped_steps == [2] and store.pending_steps() == [1]
        gate.set()
        store.wait_until_finished()
        assert store.all_steps() == [1]


def test_block_policy_waits_for_room(tmp_path, stalled):
    gate, started = stalled.gate, stalled.started
    with CheckpointStore(tmp_path, max_pending_host_copies=2, on_backpressure="block") as store:
        store.save(1, state(1))
        assert started.wait(10)
        store.save(2, state(2))  # room for one queued copy
        saver = threading.Thread(target=lambda: (store.save(3, state(3)),
                                                 stalled.events.append(("saved", 3))))
        saver.start()
        saver.join(0.5)  # a save that does not block is back by now, before step 1 commits
        gate.set()
        saver.join(30)
        # Blocked: two copies were held, so save(3) returned only after step 1 committed.
        assert stalled.events.index(("committed", 1)) < stalled.events.index(("saved", 3))
        store.wait_until_finished()
        assert store.all_steps() == [1, 2, 3] and store.dropped_steps == []


def test_invalid_policy_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_pending_host_copies"):
        CheckpointStore(tmp_path, max_pending_host_copies=0)
    with pytest.raises(ValueError, match="on_backpressure"):
        CheckpointStore(tmp_path, on_backpressure="wait")
    with pytest.raises(ValueError, match="max_to_keep"):
        CheckpointStore(tmp_path, max_to_keep=0)


def test_out_of_order_arrivals_drop_the_lowest_step(tmp_path, stalled):
    """An explicit save of a later step can be queued before earlier windows arrive; the
    lowest step is the one dropped, never the newest."""
    gate, started = stalled.gate, stalled.started
    with CheckpointStore(tmp_path, max_pending_host_copies=2) as store:
        store.save(1, state(1))
        assert started.wait(10)
        store.save(11, state(11))
        store.save(6, state(6))
        store.save(8, state(8))
        assert store.pending_steps() == [1, 11]
        assert store.dropped_steps == [6, 8]
        gate.set()
        store.wait_until_finished()
        assert store.all_steps() == [1, 11]
