"""Bitwise round trips through CheckpointStore (local directory and memory:// kvstore)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from overlap_ckpt.hostarray import HostArray, HostShard
from overlap_ckpt.storage import CheckpointStore, set_fault_hook


def bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def assert_trees_bitwise(restored, expected):
    flat_r, tree_r = jax.tree_util.tree_flatten(restored)
    flat_e, tree_e = jax.tree_util.tree_flatten(expected)
    assert tree_r == tree_e, (tree_r, tree_e)
    for r, e in zip(flat_r, flat_e):
        if isinstance(e, (int, float)) and not isinstance(e, np.generic):
            assert r == e and type(r) is type(e)
        else:
            assert bitwise_equal(r, e), (r, e)


def make_state():
    rng = np.random.default_rng(0)
    params = {
        "dense": {"kernel": rng.standard_normal((33, 17), dtype=np.float32),
                  "bias": np.zeros(17, np.float32)},
        "emb": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
    }
    opt = optax.adam(1e-3).init(params)
    return {
        "params": params,
        "opt_state": opt,
        "f32": np.float32(np.pi) * np.ones((3, 5), np.float32),
        "bf16": np.asarray([1.5, -2.25, np.nan], ml_dtypes.bfloat16),
        "i32": np.arange(-7, 7, dtype=np.int32).reshape(2, 7),
        "u8": np.arange(256, dtype=np.uint8),
        "bool": np.asarray([True, False, True]),
        "scalar_f32": np.float32(1.25),
        "scalar_i32": np.int32(-3),
        "zero_d": np.array(7, np.int32),
        "empty_array": np.zeros((0, 3), np.float32),
        "nothing": None,
        "empty_dict": {},
        "tuple": (np.ones(2, np.float16), np.uint8(9)),
    }


def to_target(tree):
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=dev), tree)


@pytest.fixture(params=["local", "memory"])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://roundtrip_{request.node.name}/ckpt"


def test_roundtrip_numpy_and_target(directory):
    state = make_state()
    with CheckpointStore(directory) as store:
        store.save(10, state, {"epoch": 3, "note": "hi"})
        store.wait_until_finished()
        assert store.all_steps() == [10] and store.latest_step() == 10
        assert store.incomplete_steps() == []

        restored, meta = store.restore()
        assert meta == {"epoch": 3, "note": "hi"}
        # Untyped restore: nested dicts/lists of numpy arrays (Orbax's untyped shape).
        assert bitwise_equal(restored["params"]["dense"]["kernel"], state["params"]["dense"]["kernel"])
        assert bitwise_equal(restored["bf16"], state["bf16"])
        assert bitwise_equal(restored["opt_state"][0]["mu"]["emb"], state["opt_state"][0].mu["emb"])
        assert restored["opt_state"][1] is None  # optax.EmptyState, saved the way Orbax does
        assert restored["nothing"] is None and restored["empty_dict"] == {}
        assert isinstance(restored["tuple"], list)

        # Typed restore onto a target: exact structure (NamedTuples, EmptyState, tuples) back.
        typed, _ = store.restore(10, to_target(state))
        assert isinstance(typed["opt_state"][0], optax.ScaleByAdamState)
        assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(typed))
        assert_trees_bitwise(jax.tree_util.tree_map(np.asarray, typed), state)

        report = store.verify()
        assert report.ok and report.steps[10].checksummed, str(report)


def test_numpy_target_and_python_scalars(tmp_path):
    tree = {"a": np.arange(6, dtype=np.float32), "lr": 0.5, "n": 3, "flag": True,
            "i64": np.array([2**40, -1], np.int64)}
    with CheckpointStore(tmp_path) as store:
        store.save(1, tree)
        store.wait_until_finished()
        back, _ = store.restore(1, {"a": np.zeros(6, np.float32), "lr": 0.0, "n": 0, "flag": False,
                                    "i64": np.zeros(2, np.int64)})
    assert_trees_bitwise(back, tree)


def test_jax_arrays_and_sharded_host_arrays(tmp_path):
    x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
    full = np.arange(40, dtype=np.int32).reshape(8, 5)
    # A HostArray captured from a 4-way row sharding: four shards, one chunk grid per shard.
    shards = [HostShard((slice(2 * i, 2 * i + 2), slice(0, 5)), full[2 * i:2 * i + 2]) for i in range(4)]
    tree = {"x": x, "h": HostArray((8, 5), np.dtype(np.int32), shards)}
    with CheckpointStore(tmp_path, chunk_bytes=16) as store:  # tiny chunks: many per shard
        store.save(0, tree)
        store.wait_until_finished()
        back, _ = store.restore()
        assert bitwise_equal(back["x"], np.asarray(x)) and bitwise_equal(back["h"], full)
        report = store.verify(0)
        assert report.ok and report.steps[0].chunks > 2, str(report)


@pytest.mark.parametrize("cut, chunks", [(7, 1), (256, 2)])
def test_parts_of_a_block_are_chunked_by_their_grid_only_when_coarse(tmp_path, cut, chunks):
    """The host replay hands over a leaf as row parts of its blocks (its calls' outputs).
    Cut at coarse rows (as it cuts large leaves), chunks tile the parts, so that TensorStore
    writes each from one part without a copy; cut at any row, chunks follow the blocks, not
    the parts' grid (here one row per chunk)."""
    full = np.arange(512 * 8, dtype=np.float32).reshape(512, 8)
    parts = [HostShard((slice(0, cut), slice(0, 8)), full[:cut]), HostShard((slice(cut, 512), slice(0, 8)), full[cut:])]
    tree = {"h": HostArray((512, 8), np.dtype(np.float32), parts, blocks=((slice(0, 512), slice(0, 8)),))}
    with CheckpointStore(tmp_path) as store:
        store.save(0, tree)
        store.wait_until_finished()
        back, _ = store.restore()
        assert bitwise_equal(back["h"], full)
        report = store.verify(0)
        assert report.ok and report.steps[0].chunks == chunks, str(report)


def test_save_is_non_blocking_and_buffers_are_referenced(tmp_path):
    """save() returns while the persist is held at its first stage: the hook has not been
    released when save() is back (a blocking save would wait for the gate to time out)."""
    import threading

    entered, gate, released = threading.Event(), threading.Event(), threading.Event()

    def hook(stage, info):
        if stage == "start":
            entered.set()
            gate.wait(30)
            released.set()

    previous = set_fault_hook(hook)
    try:
        with CheckpointStore(tmp_path) as store:
            store.save(1, {"w": np.ones((256, 256), np.float32)})
            assert not released.is_set()  # returned while the persist is held
            assert entered.wait(30)  # ...and the persist is under way in the background
            assert store.pending_steps() == [1] and store.all_steps() == []
            gate.set()
            store.wait_until_finished()
            assert store.all_steps() == [1]
            assert store.history[-1].nbytes == 256 * 256 * 4
    finally:
        gate.set()
        set_fault_hook(previous)


def test_memory_url_is_shared_within_process_and_uses_commit_marker():
    url = "memory://shared_roundtrip/run"
    with CheckpointStore(url) as store:
        store.save(5, {"a": np.arange(3)})
        store.wait_until_finished()
        assert store.location.exists("5/commit_success.txt")
    with CheckpointStore(url, read_only=True) as reader:
        assert reader.all_steps() == [5]
        back, _ = reader.restore()
        assert bitwise_equal(back["a"], np.arange(3))


def test_rejects_bad_leaves_synchronously(tmp_path):
    with CheckpointStore(tmp_path) as store:
        with pytest.raises(TypeError, match=r"\['s'\]"):
            store.save(1, {"s": "a string"})
        with pytest.raises(ValueError, match="same key path|array name"):
            store.save(1, {"a.b": np.ones(1), "a": {"b": np.ones(1)}})
        with pytest.raises(TypeError, match="JSON"):
            store.save(1, {"a": np.ones(1)}, {"bad": object()})
        assert store.pending_steps() == []
