"""Reading a committed step back: as numpy (no target) or resharded onto a target.

Why TensorStore reads of shard domains: a restore onto a different mesh, device count or
sharding must not assemble whole arrays on every host. For each target leaf we ask the
target sharding which index of the global array each *addressable* device needs, read
exactly those domains (deduplicated: replicas share one read), and build the global
``jax.Array`` from per-device buffers (:func:`jax.make_array_from_single_device_arrays`).
When this process's devices together need the whole array (single-process jobs), one
read of the whole array is issued instead, so no chunk is read twice. Reads of all leaves
are in flight at once, bounded by bytes. Each chunk's crc32c is checked by TensorStore as
it is decoded.

Reads land in 64-byte aligned buffers that we allocate, which the CPU client adopts
without a copy; on accelerators ``device_put`` is the one host-to-device transfer.

Works on Orbax-written steps too: zarr v2 or v3, OCDBT or one directory per array.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
from typing import Any, Callable, Iterable

import jax
import numpy as np
import tensorstore as ts

from ..hostarray import full_index, index_key, normalize_index
from . import layout, writer
from .errors import CorruptCheckpointError, InvalidMetadataError, TargetMismatchError, read_error
from .location import Location
from .tree import (KEY_SEQUENCE, VT_DICT, VT_LIST, VT_SCALAR, VT_TUPLE, flatten, is_empty_node,
                   key_name_and_type, path_str)


#: When this process's devices need the whole array, read it once and slice it on the host
#: (each chunk read and checksummed once) instead of once per distinct device domain. Tests
#: turn it off to exercise the per-domain reads that multi-process restores use.
WHOLE_READ_WHEN_ADDRESSABLE = True


@dataclasses.dataclass
class StepView:
    """A committed step's validated metadata, ready to open its arrays."""

    location: Location
    step: int | None
    step_rel: str
    item_rel: str
    tree: layout.TreeMetadata
    manifest: dict[str, layout.ArrayRecord] | None
    custom_metadata: dict

    @property
    def where(self) -> str:
        return self.location.describe(self.item_rel)

    def array_leaves(self) -> list[layout.SavedLeaf]:
        return [leaf for leaf in self.tree.leaves if leaf.is_array]


def open_step(location: Location, step: int | None, step_rel: str, item_name: str) -> StepView:
    """Read and validate the metadata of one step directory."""
    item = item_name
    if location.list_children(f"{step_rel}/{item}") and not location.exists(f"{step_rel}/{item}/{layout.TREE_METADATA}"):
        raise CorruptCheckpointError(
            f"{location.describe(step_rel)} is damaged: its item {item!r} has no {layout.TREE_METADATA} "
            "file (deleted or never written); restore an earlier step.", step=step,
            path=location.describe(f"{step_rel}/{item}"))
    if not location.exists(f"{step_rel}/{item}/{layout.TREE_METADATA}"):
        # Orbax managers may name the item differently: accept a single item directory.
        candidates = [n for n in location.list_children(step_rel)
                      if location.exists(f"{step_rel}/{n}/{layout.TREE_METADATA}")]
        if len(candidates) != 1:
            raise InvalidMetadataError(
                f"{location.describe(step_rel)} has no item {item_name!r} with a "
                f"{layout.TREE_METADATA} file (items found: {candidates}). Pass item_name= to "
                "CheckpointStore, or the step is damaged: restore another one.", step=step,
                path=location.describe(step_rel))
        item = candidates[0]
    item_rel = f"{step_rel}/{item}"
    what = location.describe(f"{item_rel}/{layout.TREE_METADATA}")
    raw = location.read_bytes(f"{item_rel}/{layout.TREE_METADATA}", layout.MAX_METADATA_BYTES)
    tree = layout.parse_tree_metadata(raw or b"", what)
    manifest = None
    raw_manifest = location.read_bytes(f"{item_rel}/{layout.MANIFEST}", layout.MAX_METADATA_BYTES)
    if raw_manifest is not None:
        manifest = layout.parse_manifest(raw_manifest, location.describe(f"{item_rel}/{layout.MANIFEST}"))
        saved = {leaf.name for leaf in tree.leaves if leaf.is_array}
        if saved != set(manifest):
            raise InvalidMetadataError(
                f"{what} and {layout.MANIFEST} list different arrays "
                f"({sorted(saved ^ set(manifest))[:5]}...); the step was modified after commit.",
                step=step, path=what)
    custom: dict = {}
    raw_step = location.read_bytes(f"{step_rel}/{layout.STEP_METADATA}", layout.MAX_METADATA_BYTES)
    if raw_step is not None:
        doc = layout.parse_step_metadata(raw_step, location.describe(f"{step_rel}/{layout.STEP_METADATA}"))
        custom = dict(doc.get("custom_metadata") or {})
    return StepView(location, step, step_rel, item_rel, tree, manifest, custom)


def item_kvstore(view: StepView, context: ts.Context) -> ts.KvStore:
    """The kvstore of the item's arrays, opened once for all of them: the step's OCDBT
    database, or the item directory (a sub-directory per array) where the step was written
    without OCDBT. Opening is lazy: a damaged database is reported when an array is opened."""
    use_ocdbt = view.tree.use_ocdbt
    if use_ocdbt is None:
        use_ocdbt = view.location.exists(f"{view.item_rel}/manifest.ocdbt")
    spec = (writer.ocdbt_spec(view.location, view.item_rel) if use_ocdbt
            else view.location.kvstore_spec(view.item_rel))
    return ts.KvStore.open(spec, context=context).result()


@functools.lru_cache(maxsize=8)
def open_spec(driver: str, fill_missing_data_reads: bool) -> ts.Spec:
    """How every array of a step is opened, parsed once (as :func:`writer.create_spec`: a JSON
    spec per leaf cost more than the opens themselves)."""
    return ts.Spec({
        "driver": driver,
        "open": True,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        # Our steps (and Orbax's) store every chunk: a missing one is an error, not zeros.
        "fill_missing_data_reads": fill_missing_data_reads,
    })


def open_arrays(view: StepView, names: Iterable[str], context: ts.Context) -> dict[str, ts.TensorStore]:
    """Open every named array concurrently and validate it against the manifest."""
    names = [layout.validate_array_name(n) for n in names]
    arrays = item_kvstore(view, context)
    spec = open_spec("zarr3" if view.tree.use_zarr3 else "zarr", not view.tree.data_complete)
    futures = {n: ts.open(spec, kvstore=arrays / f"{n}/", context=context, read=True) for n in names}
    stores = {}
    for name, fut in futures.items():
        try:
            store = fut.result()
        except Exception as e:  # noqa: BLE001 - translated to a storage error
            raise read_error(e, step=view.step, path=view.where, array=name) from e
        record = view.manifest.get(name) if view.manifest else None
        layout.check_zarr_spec(name, store, record, view.where)
        if record is not None and record.checksummed and not layout.has_crc32c(store):
            raise InvalidMetadataError(
                f"{view.where}: array {name!r} lost its crc32c codec; its zarr.json was modified "
                "after it was written. Restore another step.", step=view.step, path=view.where)
        stores[name] = store
    return stores


def bounded(tasks: list, *, nbytes: Callable[[Any], int], issue: Callable[[Any], Any],
            finish: Callable[[Any, Any], None], budget: int) -> None:
    """Issue ``issue(task)`` for tasks in order, keeping at most ~``budget`` bytes in flight,
    and call ``finish(task, future)`` in order as they complete."""
    window: collections.deque = collections.deque()
    inflight = 0
    try:
        for task in tasks:
            n = nbytes(task)
            while window and inflight + n > budget:
                done, fut, size = window.popleft()
                inflight -= size
                finish(done, fut)
            window.append((task, issue(task), n))
            inflight += n
        while window:
            done, fut, _ = window.popleft()
            finish(done, fut)
    finally:
        for _, fut, _ in window:  # drain on error so no read outlives the call
            try:
                fut.result()
            except Exception:  # noqa: BLE001
                pass


@functools.lru_cache(maxsize=1)
def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 62


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialized array whose data is ``align``-byte aligned: XLA's CPU client can then
    adopt it as a device buffer without a copy (``device_put(..., may_alias=True)``)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class PendingRead:
    """A TensorStore read straight into a freshly allocated, aligned numpy array.

    Why not ``store.read()``: writing the source into a ``ts.array`` view of our own buffer
    streams chunk by chunk into memory we later hand to JAX without another copy, and is
    measurably faster than letting TensorStore allocate the result.
    """

    def __init__(self, source: ts.TensorStore, dtype: np.dtype):
        if source.dtype.numpy_dtype != dtype:
            source = ts.cast(source, ts.dtype(dtype))
        nbytes = math.prod(int(n) for n in source.shape) * np.dtype(dtype).itemsize
        if nbytes > _host_memory_bytes():
            raise InvalidMetadataError(
                f"Refusing to allocate {nbytes} bytes for a read of shape {tuple(source.shape)} "
                f"{np.dtype(dtype)}: more than this host's memory ({_host_memory_bytes()} bytes). "
                "The array's metadata is corrupt or crafted, or the array must be restored onto "
                "a sharded target so that each host reads only its part.")
        self.out = aligned_empty(tuple(source.shape), dtype)
        self._future = ts.array(self.out, copy=False, write=True).write(source) if self.out.size else None

    def result(self) -> np.ndarray:
        if self._future is not None:
            self._future.result()
        return self.out


def _read(view: StepView, name: str, pending: PendingRead) -> np.ndarray:
    try:
        return pending.result()
    except Exception as e:  # noqa: BLE001
        raise read_error(e, step=view.step, path=view.where, array=name) from e


# -- untyped restore -----------------------------------------------------------------------

def restore_numpy(view: StepView, context: ts.Context, budget: int) -> Any:
    """The saved tree as nested dicts/lists of numpy arrays (Orbax's untyped restore shape)."""
    leaves = view.array_leaves()
    stores = open_arrays(view, [leaf.name for leaf in leaves], context)
    values: dict[str, Any] = {}

    def finish(leaf, fut):
        array = _read(view, leaf.name, fut)
        values[leaf.name] = array.item() if leaf.value_type == VT_SCALAR else array

    bounded(leaves, nbytes=lambda leaf: stored_nbytes(stores[leaf.name]),
            issue=lambda leaf: PendingRead(stores[leaf.name], stores[leaf.name].dtype.numpy_dtype),
            finish=finish, budget=budget)
    root: dict = {}
    for leaf in view.tree.leaves:
        value = values[leaf.name] if leaf.is_array else _empty_value(leaf.value_type)
        node = root
        for key in leaf.keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise InvalidMetadataError(f"{view.where}: key path {leaf.keys} crosses a leaf.",
                                           path=view.where)
        node[leaf.keys[-1]] = value
    types = {leaf.keys[:i + 1]: leaf.key_types[i] for leaf in view.tree.leaves
             for i in range(len(leaf.keys))}
    return _lists_where_sequence(root, (), types)


def stored_nbytes(store: ts.TensorStore) -> int:
    return int(np.prod(store.shape, dtype=np.int64)) * store.dtype.numpy_dtype.itemsize


def _empty_value(value_type: str) -> Any:
    return {VT_DICT: {}, VT_LIST: [], VT_TUPLE: ()}.get(value_type)


def _lists_where_sequence(node: Any, prefix: tuple, types: dict) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists_where_sequence(v, prefix + (k,), types) for k, v in node.items()}
    if out and all(types.get(prefix + (k,)) == KEY_SEQUENCE for k in out):
        try:
            order = sorted(out, key=int)
        except ValueError:
            return out
        if [int(k) for k in order] == list(range(len(order))):
            return [out[k] for k in order]
    return out


# -- restore onto a target ---------------------------------------------------------------------

@dataclasses.dataclass
class _Want:
    name: str
    display: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Any  # jax.sharding.Sharding | None; None with numpy=True/False
    as_numpy: bool
    as_scalar: bool
    position: int


def _describe_target(leaf: Any, display: str) -> tuple[tuple, np.dtype, Any, bool, bool]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return tuple(leaf.shape), np.dtype(leaf.dtype), getattr(leaf, "sharding", None), False, False
    if isinstance(leaf, jax.Array):
        return tuple(leaf.shape), np.dtype(leaf.dtype), leaf.sharding, False, False
    if isinstance(leaf, (np.ndarray, np.generic)):
        return tuple(np.shape(leaf)), np.asarray(leaf).dtype, None, True, False
    if isinstance(leaf, (bool, int, float, complex)):
        return (), np.asarray(leaf).dtype, None, True, True
    raise TargetMismatchError(
        f"Target leaf {display} is a {type(leaf).__name__}; targets must hold "
        "jax.ShapeDtypeStruct, jax.Array, numpy arrays or Python scalars.")


def restore_target(view: StepView, target: Any, context: ts.Context, budget: int,
                   allow_cast: bool) -> Any:
    flat = flatten(target)
    treedef = jax.tree_util.tree_structure(target, is_leaf=is_empty_node)
    saved = {leaf.name: leaf for leaf in view.tree.leaves}
    out: list[Any] = [None] * len(flat)
    wants: list[_Want] = []
    problems: list[str] = []
    target_names = set()
    for i, (keypath, leaf) in enumerate(flat):
        name = ".".join(key_name_and_type(k)[0] for k in keypath)
        display = path_str(keypath)
        target_names.add(name)
        if is_empty_node(leaf):
            out[i] = leaf
            if name in saved and saved[name].is_array:
                problems.append(f"{display}: target has an empty node, the checkpoint an array")
            continue
        if name not in saved or not saved[name].is_array:
            problems.append(f"{display}: not in the checkpoint (array {name!r} missing)")
            continue
        shape, dtype, sharding, as_numpy, as_scalar = _describe_target(leaf, display)
        wants.append(_Want(name, display, shape, dtype, sharding, as_numpy, as_scalar, i))
    extra = sorted(n for n, leaf in saved.items() if leaf.is_array and n not in target_names)
    if extra:
        problems.append(f"the checkpoint has arrays the target lacks: {extra[:10]}"
                        + (" ..." if len(extra) > 10 else ""))
    if problems:
        raise TargetMismatchError(
            f"The restore target does not match step {view.step} in {view.where}:\n  "
            + "\n  ".join(problems[:20])
            + "\nPass a target with the saved structure, or target=None to get the saved tree.",
            step=view.step, path=view.where)

    stores = open_arrays(view, [w.name for w in wants], context)
    for w in wants:
        store = stores[w.name]
        saved_dtype = store.dtype.numpy_dtype
        if tuple(store.shape) != w.shape:
            problems.append(f"{w.display}: saved shape {tuple(store.shape)} {saved_dtype}, "
                            f"target {w.shape} {w.dtype}")
        elif saved_dtype != w.dtype and not allow_cast:
            problems.append(f"{w.display}: saved dtype {saved_dtype}, target {w.dtype} "
                            "(pass allow_cast=True to convert)")
    if problems:
        raise TargetMismatchError(
            f"Shapes/dtypes of the restore target differ from step {view.step} in {view.where}:\n  "
            + "\n  ".join(problems[:20]), step=view.step, path=view.where)

    tasks = []  # (want, index or None for whole array)
    for w in wants:
        if w.as_numpy or w.sharding is None or (WHOLE_READ_WHEN_ADDRESSABLE
                                                 and w.sharding.is_fully_addressable):
            tasks.append((w, None))
        else:
            indices = {index_key(normalize_index(idx, w.shape)): normalize_index(idx, w.shape)
                       for idx in w.sharding.addressable_devices_indices_map(w.shape).values()}
            tasks.extend((w, indices[k]) for k in sorted(indices))
    blocks: dict[tuple[str, Any], np.ndarray] = {}
    remaining = collections.Counter(w.name for w, _ in tasks)

    def nbytes(task):
        w, idx = task
        extent = w.shape if idx is None else tuple(s.stop - s.start for s in idx)
        return int(np.prod(extent, dtype=np.int64)) * w.dtype.itemsize

    def issue(task):
        w, idx = task
        store = stores[w.name]
        return PendingRead(store[idx] if idx else store, w.dtype)  # cast by TensorStore if allowed

    def finish(task, fut):
        w, idx = task
        block = _read(view, w.name, fut)
        blocks[(w.name, None if idx is None else index_key(idx))] = block
        remaining[w.name] -= 1
        if remaining[w.name] == 0:
            out[w.position] = _assemble(w, blocks)

    bounded(tasks, nbytes=nbytes, issue=issue, finish=finish, budget=budget)
    return jax.tree_util.tree_unflatten(treedef, out)


def _assemble(w: _Want, blocks: dict) -> Any:
    """Build the output leaf from its read blocks, then drop them (bounded host memory)."""
    if w.as_numpy:
        array = blocks.pop((w.name, None))
        return array.item() if w.as_scalar else array
    whole = blocks.pop((w.name, None), None)
    if w.sharding is None:
        return jax.device_put(whole, may_alias=True)
    mine = {k[1]: v for k, v in list(blocks.items()) if k[0] == w.name}
    for k in mine:
        blocks.pop((w.name, k))
    per_device, used = [], set()
    for device, index in w.sharding.addressable_devices_indices_map(w.shape).items():
        index = normalize_index(index, w.shape)
        key = index_key(index)
        if whole is not None:
            block = whole if index == full_index(w.shape) else whole[index]
        else:
            block = mine[key]
        # Our buffers are private, so the first device of each block may adopt it without a
        # copy; replicas get copies (a donated replica must not scribble on another's data).
        per_device.append(jax.device_put(block, device, may_alias=key not in used))
        used.add(key)
    return jax.make_array_from_single_device_arrays(w.shape, w.sharding, per_device)
