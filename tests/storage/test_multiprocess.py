"""The multi-process seam, simulated with two stores in one process (threads as processes).

Each "process" holds only its own shards (HostArray with local blocks), writes them into
its own ``ocdbt.process_<i>`` database, and only the primary merges, writes metadata and
commits. The result must restore as one array, with our reader and with stock Orbax.
"""

from __future__ import annotations

import threading

import numpy as np
import orbax.checkpoint as ocp

from overlap_ckpt.hostarray import HostArray, HostShard
from overlap_ckpt.storage import CheckpointStore


class ThreadCoordinator:
    def __init__(self, index: int, count: int, barrier: threading.Barrier):
        self.process_index, self.process_count, self._barrier = index, count, barrier

    def is_primary(self) -> bool:
        return self.process_index == 0

    def barrier(self, name: str) -> None:
        self._barrier.wait(timeout=30)


def local_tree(full_w: np.ndarray, full_b: np.ndarray, index: int) -> dict:
    rows = slice(4 * index, 4 * index + 4)
    w = HostArray(full_w.shape, full_w.dtype, [HostShard((rows, slice(0, 6)), full_w[rows])])
    # b is replicated: only process 0 owns the (single) replica it writes.
    b_shards = [HostShard((slice(0, 3),), full_b)] if index == 0 else []
    return {"w": w, "b": HostArray(full_b.shape, full_b.dtype, b_shards)}


def test_two_processes_write_their_shards_primary_commits(tmp_path):
    full_w = np.arange(48, dtype=np.float32).reshape(8, 6)
    full_b = np.asarray([1, 2, 3], np.int32)
    barrier = threading.Barrier(2)
    primary = CheckpointStore(tmp_path, coordinator=ThreadCoordinator(0, 2, barrier))
    secondary = CheckpointStore(tmp_path, coordinator=ThreadCoordinator(1, 2, barrier))
    try:
        for step in (1, 2):
            secondary.save(step, local_tree(full_w + step, full_b, 1))
            primary.save(step, local_tree(full_w + step, full_b, 0), {"step": step})
        secondary.wait_until_finished()
        primary.wait_until_finished()
        assert sorted(p.name for p in (tmp_path / "2" / "default").glob("ocdbt.process_*")) == [
            "ocdbt.process_0", "ocdbt.process_1"]
        tree, meta = primary.restore(2)
        assert meta == {"step": 2}
        assert tree["w"].tobytes() == (full_w + 2).tobytes() and tree["b"].tobytes() == full_b.tobytes()
        assert primary.verify().ok
        orbax_manager = ocp.CheckpointManager(str(tmp_path))
        orbax_tree = orbax_manager.restore(1)
        orbax_manager.close()
        assert np.asarray(orbax_tree["w"]).tobytes() == (full_w + 1).tobytes()
    finally:
        secondary.close()
        primary.close()
