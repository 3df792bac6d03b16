"""The store's ``checksums`` option.

With ``checksums=False`` a checkpoint is written without chunk crc32c (read back from the
array metadata by TensorStore directly), restores bit for bit through stock Orbax and through
the store, and says so (``verify``; a manifest version that older releases refuse with
"upgrade"). With the default, a step's arrays keep the codec, and an array whose zarr.json
lost it is refused, not read.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts

import overlap_ckpt as oc
from overlap_ckpt.storage.errors import InvalidMetadataError
from overlap_ckpt.tiers import TieredStore
from overlap_ckpt.storage import CheckpointStore

from .test_orbax_compat import abstract, bits, state


def item_kvstore(root, step: int) -> dict:
    return {"driver": "ocdbt", "base": f"file://{root}/{step}/default/"}


def codecs(root, step: int, name: str) -> list[str]:
    """The codec names of one array, as TensorStore opens it from the step's OCDBT database."""
    store = ts.open({"driver": "zarr3", "kvstore": {**item_kvstore(root, step), "path": name + "/"}},
                    read=True).result()
    return [c["name"] for c in store.codec.to_json()["codecs"]]


def manifest(root, step: int) -> dict:
    return json.loads((root / str(step) / "default" / "_overlap_ckpt.json").read_text())


@pytest.mark.parametrize("checksums", [True, False])
def test_checkpoints_with_and_without_checksums_restore_bitwise(tmp_path, checksums):
    tree, root = state(), tmp_path / "ck"
    with CheckpointStore(root, checksums=checksums) as store:
        store.save(7, tree)
        store.wait_until_finished()
        report = store.verify()
        typed, _ = store.restore(7, abstract(tree))
    assert report.ok and report.steps[7].checksummed is checksums, str(report)
    array_names = manifest(root, 7)["arrays"]
    assert len(array_names) == report.steps[7].arrays > 1
    for name in array_names:
        assert codecs(root, 7, name) == (["bytes", "crc32c"] if checksums else ["bytes"]), name
    # Every release reads a checksummed step; one without checksums says "upgrade" to those
    # that know only format_version 1, rather than "lost its crc32c codec".
    assert manifest(root, 7)["format_version"] == (1 if checksums else 2)
    for got, want in zip(jax.tree_util.tree_leaves(typed), jax.tree_util.tree_leaves(tree)):
        assert bits(got) == bits(want)
    orbax = ocp.StandardCheckpointer().restore(str(root / "7" / "default"), abstract(tree))
    for got, want in zip(jax.tree_util.tree_leaves(orbax), jax.tree_util.tree_leaves(tree)):
        assert bits(got) == bits(want)


def test_a_checksummed_array_whose_metadata_lost_the_codec_is_refused(tmp_path):
    tree, root = state(), tmp_path / "ck"
    with CheckpointStore(root) as store:
        store.save(7, tree)
        store.wait_until_finished()
    kv = ts.KvStore.open(item_kvstore(root, 7)).result()
    doc = json.loads(kv.read("params.w/zarr.json").result().value)
    doc["codecs"] = [c for c in doc["codecs"] if c["name"] != "crc32c"]
    kv.write("params.w/zarr.json", json.dumps(doc).encode()).result()
    with CheckpointStore(root, read_only=True) as store:
        with pytest.raises(InvalidMetadataError, match="'params.w' lost its crc32c codec"):
            store.restore(7, abstract(tree))


def test_the_local_tier_writes_as_the_durable_store_does(tmp_path):
    durable, local = tmp_path / "durable", tmp_path / "local"
    tiers = TieredStore(CheckpointStore(durable, checksums=False), oc.LocalTier(local, every=2), interval=4)
    tiers.save(4, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})  # an explicit save: both tiers
    tiers.flush()
    tiers.close()
    assert codecs(durable, 4, "w") == ["bytes"]
    assert codecs(local, 4, "w") == ["bytes"]
