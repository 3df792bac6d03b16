"""Stock Orbax restores our checkpoints bit for bit, and we restore Orbax's."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from overlap_ckpt.storage import CheckpointStore


def state():
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((16, 8), dtype=np.float32),
              "b": rng.standard_normal(8).astype(ml_dtypes.bfloat16)}
    return {"params": params, "opt_state": optax.adam(1e-2).init(params),
            "step": np.int32(42), "mask": np.asarray([True, False]), "bytes": np.arange(9, dtype=np.uint8)}


def bits(x):
    x = np.asarray(x)
    return x.shape, x.dtype, x.tobytes()


def abstract(tree):
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=dev), tree)


def test_stock_orbax_restores_our_checkpoint(tmp_path):
    tree = state()
    with CheckpointStore(tmp_path / "ck") as store:
        store.save(7, tree, {"data_position": 1234})
        store.wait_until_finished()

    # CheckpointManager with no arguments: handler from _CHECKPOINT_METADATA, untyped restore.
    mngr = ocp.CheckpointManager(str(tmp_path / "ck"))
    assert mngr.all_steps() == [7]
    restored = mngr.restore(7)
    assert bits(restored["params"]["w"]) == bits(tree["params"]["w"])
    assert bits(restored["params"]["b"]) == bits(tree["params"]["b"])
    assert bits(restored["opt_state"][0]["nu"]["w"]) == bits(tree["opt_state"][0].nu["w"])
    assert bits(restored["step"]) == bits(tree["step"])
    assert mngr.metadata(7).custom_metadata == {"data_position": 1234}
    mngr.close()

    # StandardCheckpointer on the item directory with an abstract target: typed jax.Arrays.
    typed = ocp.StandardCheckpointer().restore(str(tmp_path / "ck" / "7" / "default"), abstract(tree))
    assert isinstance(typed["opt_state"][0], optax.ScaleByAdamState)
    for got, want in zip(jax.tree_util.tree_leaves(typed), jax.tree_util.tree_leaves(tree)):
        assert bits(got) == bits(want)


def test_we_restore_stock_orbax_checkpoint(tmp_path):
    tree = state()
    jtree = jax.tree_util.tree_map(jnp.asarray, tree)
    mngr = ocp.CheckpointManager(str(tmp_path / "orbax"))
    mngr.save(3, args=ocp.args.StandardSave(jtree))
    mngr.wait_until_finished()
    mngr.close()

    with CheckpointStore(tmp_path / "orbax") as store:
        assert store.all_steps() == [3]
        untyped, meta = store.restore()
        assert meta == {}
        assert bits(untyped["params"]["w"]) == bits(tree["params"]["w"])
        assert bits(untyped["opt_state"][0]["mu"]["b"]) == bits(tree["opt_state"][0].mu["b"])
        typed, _ = store.restore(3, abstract(tree))
        for got, want in zip(jax.tree_util.tree_leaves(typed), jax.tree_util.tree_leaves(tree)):
            assert bits(got) == bits(want)
        report = store.verify()
        assert report.ok and not report.steps[3].checksummed  # Orbax writes no chunk crc32c


def test_layout_matches_orbax(tmp_path):
    with CheckpointStore(tmp_path / "ck") as store:
        store.save(1, {"a": np.ones(3, np.float32)})
        store.wait_until_finished()
    step = tmp_path / "ck" / "1"
    assert sorted(os.listdir(step)) == ["_CHECKPOINT_METADATA", "commit_success.txt", "default"]
    item = sorted(os.listdir(step / "default"))
    for name in ("_METADATA", "manifest.ocdbt", "d", "ocdbt.process_0"):
        assert name in item
    meta = json.loads((step / "default" / "_METADATA").read_text())
    assert meta["use_ocdbt"] is True and meta["use_zarr3"] is True
    step_meta = json.loads((step / "_CHECKPOINT_METADATA").read_text())
    assert step_meta["item_handlers"]["default"].endswith("StandardCheckpointHandler")


@pytest.mark.parametrize("item", ["state"])
def test_we_restore_named_orbax_item(tmp_path, item):
    tree = {"x": np.arange(5, dtype=np.float32)}
    mngr = ocp.CheckpointManager(str(tmp_path / "o"))
    mngr.save(1, args=ocp.args.Composite(**{item: ocp.args.StandardSave(tree)}))
    mngr.wait_until_finished()
    mngr.close()
    with CheckpointStore(tmp_path / "o", read_only=True) as store:
        back, _ = store.restore()
    assert bits(back["x"]) == bits(tree["x"])
