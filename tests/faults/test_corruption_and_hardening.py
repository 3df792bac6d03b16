"""Damage after the fact, crafted metadata, and a second live manager.

Decision (documented in docs/troubleshooting.md): ``latest_step()`` lists committed steps
from directory names only and does **not** skip a corrupt step (detecting it means reading
every byte). What is guaranteed is that a damaged step never restores *wrongly*: restoring
it raises a :class:`CheckpointError` naming the step (and the array), and ``verify()``
reports it; restore the previous step (``all_steps()[-2]``) in that case.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import tensorstore as ts

from overlap_ckpt.manager import CheckpointManager
from overlap_ckpt.storage import (CheckpointError, CheckpointLockedError, CheckpointStore,
                                  IncompleteCheckpointError)
from overlap_ckpt.storage import restore as restore_mod

from . import record, worker
from .damage import DAMAGE


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("corrupt")
    ref = base / "ref"
    ref.mkdir()
    worker.run(base / "ck", 14)  # commits 4, 8, 12; keeps [8, 12]
    worker.run(base / "reference", 18, ref_dir=ref)  # same seed: snapshots at 4, 8, 12, 16
    snaps = {int(p.stem): dict(np.load(p)) for p in ref.glob("[0-9]*.npz")}
    return base / "ck", snaps


@pytest.fixture
def ck(pristine, tmp_path):
    src, snaps = pristine
    dst = tmp_path / "ck"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".overlap_ckpt.lock"))
    return dst, snaps


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damage_never_restores_wrongly(ck, name):
    """docs/troubleshooting.md: damaged data or OCDBT metadata makes restore raise a
    CheckpointError naming the step (and verify report it); optional files and stray tmp
    dirs are harmless."""
    root, snaps = ck
    damage, error = DAMAGE[name]
    damage(root)
    with CheckpointStore(root, read_only=True) as store:
        latest = store.latest_step()
        assert latest == 12  # latest_step() never names the stray tmp dir, nor skips damage
        report = store.verify()
        if error is None:
            wrong = int(not worker.same_bits(worker.restore_snapshot(root, 12), snaps[12]))
            outcome = "harmless: restore of 12 exact, verify ok"
        else:
            with pytest.raises(CheckpointError) as info:
                worker.restore_snapshot(root, 12)
            wrong = 0
            outcome = f"restore raised {type(info.value).__name__} naming step 12; verify FAILED; step 8 exact"
        record(f"corruption: {name}", wrong=wrong, outcome=outcome)
        assert wrong == 0
        if error is None:
            assert report.ok, str(report)
        else:  # exactly the promised class, naming the step; verify agrees; 8 is intact
            assert type(info.value) is error and info.value.step == 12 and "12" in str(info.value)
            assert not report.ok and report.failed_steps == [12], str(report)
            assert worker.same_bits(worker.restore_snapshot(root, 8), snaps[8])
        if name.startswith("stray"):
            assert store.incomplete_steps() == [16]
            with pytest.raises(IncompleteCheckpointError, match="partial"):
                store.restore(16)
    if name.startswith("stray"):  # the next save replaces it with the real step 16
        result = worker.run(root, 18, resume=True)
        assert not result["errors"] and not (root / "16.orbax-checkpoint-tmp").exists()
        assert worker.same_bits(worker.restore_snapshot(root, 16), snaps[16])


# -- crafted metadata ---------------------------------------------------------------------------

def _meta(root):
    return root / "12" / "default" / "_METADATA"


def _rename_leaf(root, key):
    path = _meta(root)
    meta = json.loads(path.read_text())
    label = next(k for k in meta["tree_metadata"] if "step" in k)
    entry = meta["tree_metadata"].pop(label)
    entry["key_metadata"] = [{"key": key, "key_type": 2}]
    meta["tree_metadata"][f"('{key}',)"] = entry
    path.write_text(json.dumps(meta))


def _kv(root):
    from overlap_ckpt.storage import writer
    from overlap_ckpt.storage.location import open_location
    ctx = writer.make_context(ts.Context())
    loc = open_location(str(root), ctx)
    spec = writer.ocdbt_spec(loc, "12/default")
    return ts.KvStore.open(spec, context=ctx).result()


def _edit_array(root, name, edit):
    """Rewrite zarr.json of array ``name`` inside the OCDBT database and the manifest alike."""
    kv = _kv(root)
    key = f"{name}/zarr.json"
    doc = json.loads(kv.read(key).result().value)
    edit(doc)
    kv.write(key, json.dumps(doc).encode()).result()
    mpath = root / "12" / "default" / "_overlap_ckpt.json"
    manifest = json.loads(mpath.read_text())
    rec = manifest["arrays"][name]
    if "shape" in rec:
        rec["shape"] = doc["shape"]
    if "dtype" in rec:
        rec["dtype"] = doc["data_type"]
    mpath.write_text(json.dumps(manifest))


CRAFTED = {
    "array key '..'": lambda r: _rename_leaf(r, ".."),
    "array key '../../escape'": lambda r: _rename_leaf(r, "../../escape"),
    "absolute array key '/tmp/escape'": lambda r: _rename_leaf(r, "/tmp/escape"),
    "huge shape (2**40 x 2**40)": lambda r: _edit_array(
        r, "params.dense1.kernel", lambda d: d.update(shape=[2**40, 2**40])),
    "shape larger than host RAM (2**38 x 16 float32)": lambda r: _edit_array(
        r, "params.dense1.kernel", lambda d: d.update(shape=[2**38, 16])),
    "wrong dtype (float32 -> int64)": lambda r: _edit_array(
        r, "params.dense1.kernel", lambda d: d.update(data_type="int64")),
    "manifest shape differs from zarr.json": lambda r: (lambda p: p.write_text(
        json.dumps(_shape_edit(json.loads(p.read_text())))))(r / "12" / "default" / "_overlap_ckpt.json"),
}


def _shape_edit(doc):
    doc["arrays"]["params.dense1.kernel"]["shape"] = [3, 3]
    return doc


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_metadata_rejected_before_allocation(ck, name, monkeypatch, tmp_path):
    root, snaps = ck
    CRAFTED[name](root)
    allocations = []
    real = restore_mod.aligned_empty

    def guarded(shape, dtype, align=64):
        n = int(np.prod(shape, dtype=np.float64)) * np.dtype(dtype).itemsize
        allocations.append(n)
        assert n < 1 << 30, f"allocation of {n} bytes from crafted metadata"
        return real(shape, dtype, align)

    monkeypatch.setattr(restore_mod, "aligned_empty", guarded)
    before = set(os.listdir(tmp_path)) | set(os.listdir("/tmp"))
    with CheckpointStore(root, read_only=True) as store:
        for target in (None, "state"):
            with pytest.raises((CheckpointError, ValueError)) as info:
                if target is None:
                    store.restore(12)
                else:
                    worker.restore_snapshot(root, 12)
            assert "12" in str(info.value) or "_METADATA" in str(info.value) or \
                "not allowed" in str(info.value) or "crafted" in str(info.value), info.value
        assert not store.verify(12).ok
    assert not any(n > 1 << 30 for n in allocations)
    after = set(os.listdir(tmp_path)) | set(os.listdir("/tmp"))
    assert not {n for n in after - before if "escape" in n}
    record(f"crafted metadata: {name}", outcome=f"rejected: {type(info.value).__name__}")


def test_second_live_manager_refused(ck):
    root, _ = ck
    with CheckpointManager(root, save_interval_steps=4, window=2) as first:
        with pytest.raises(CheckpointLockedError) as info:
            CheckpointManager(root, save_interval_steps=4, window=2)
        msg = str(info.value)
        assert f"pid {os.getpid()}" in msg and "already managed" in msg
        assert first.latest_step() == 12
    with CheckpointManager(root, save_interval_steps=4, window=2) as again:  # released on close
        assert again.latest_step() == 12
    record("second live manager on the same directory", outcome="refused: CheckpointLockedError naming the pid")
