"""TensorStore writes: each process puts its shards into its own OCDBT database.

Why this shape:

* **Per-process OCDBT databases** (``default/ocdbt.process_<i>/``): OCDBT has a single
  writer per database, so in a multi-process job every process writes only its own
  shards to its own database with no coordination. The primary later *merges* the
  per-process B-trees into the item root (:func:`merge_into_root`, metadata only: no
  array byte is copied). This is also exactly what Orbax does, so Orbax reads it.
* **Few commits, many writes in flight**: all writes of a batch (up to
  ``batch_bytes``) are staged in one transaction and committed at once, so OCDBT
  writes one manifest update per batch and packs chunks into data files of
  ``target_data_file_size`` that are written and fsync'd concurrently (checksumming of one
  file overlaps the I/O of the others). The byte bound caps what is staged.
* **No copies**: writes pass ``can_reference_source_data_indefinitely=True``. The host
  copy handed to the store is owned by the store until the persist ends, so TensorStore
  may reference it instead of copying it into its own buffers.
* The accelerator is never touched: sources are host ``numpy`` buffers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from ..gil import yielding
from ..hostarray import HostArray
from . import hooks, layout
from .location import Location
from .tree import Leaf, chunk_shape_for

OCDBT_CONFIG = {
    # zarr.json metadata is stored inline in B-tree nodes, array chunks in data files.
    "max_inline_value_bytes": 1024,
    # One large root node: fast traversal on restore.
    "max_decoded_node_bytes": 100_000_000,
    # One writer per database, so the simple single-file manifest suffices.
    "manifest_kind": "single",
}


@dataclasses.dataclass
class ArrayWrite:
    name: str
    host: HostArray
    chunk_shape: tuple[int, ...]
    checksums: bool = True


def prepare_arrays(leaves: Sequence[Leaf], chunk_bytes: int, *, checksums: bool = True) -> list[ArrayWrite]:
    """Validate the flattened tree (names, dtypes, collisions) and choose each array's chunks.

    Raises ``ValueError``/``TypeError`` naming the offending leaf; runs in the caller's thread
    so that a bad tree fails at ``save`` time, not in the background."""
    arrays, names, labels = [], set(), set()
    for leaf in yielding(leaves):
        label = str(leaf.keys)
        if label in labels:
            raise ValueError(f"Two leaves of the tree have the same key path {leaf.keys}.")
        labels.add(label)
        if not leaf.is_array:
            continue
        name = layout.validate_array_name(leaf.name, leaf.display)
        if name in names:
            raise ValueError(f"Leaf {leaf.display} maps to array name {name!r} like another "
                             "leaf; rename one of the keys (names join keys with '.').")
        names.add(name)
        host = leaf.value
        layout.zarr_dtype(host.dtype)  # TypeError for dtypes zarr3/TensorStore cannot store
        chunk = chunk_shape_for(host, chunk_bytes)
        arrays.append(ArrayWrite(name, host, chunk, checksums))
    return arrays


def auto_data_file_size(nbytes: int) -> int:
    """OCDBT data file size for a checkpoint of ``nbytes``: 1/64 of it within [8, 256] MiB, so
    that several data files are written and fsync'd concurrently (checksumming of one
    overlaps the I/O of the others) without creating thousands of files."""
    return int(min(max(nbytes // 64, 8 << 20), 256 << 20))


def write_item_metadata(location: Location, item_rel: str, step: int, leaves: Sequence[Leaf],
                        arrays: Sequence[ArrayWrite], process_count: int) -> None:
    """Primary only: Orbax's ``_METADATA`` and our manifest. They describe the arrays, not their
    bytes, so they are written while the data is (``write_process_shards(alongside=...)``)."""
    records = [layout.ArrayRecord(a.name, a.host.shape, a.host.dtype, a.chunk_shape, a.checksums) for a in arrays]
    location.write_bytes(f"{item_rel}/{layout.TREE_METADATA}", layout.dumps(layout.tree_metadata(leaves)))
    location.write_bytes(f"{item_rel}/{layout.MANIFEST}",
                         layout.dumps(layout.manifest(step, records, process_count)))


_OCDBT_CACHE = {"total_bytes_limit": 100_000_000}


def step_context(shared: ts.Context) -> ts.Context:
    """A child context for writing one step: shares I/O concurrency limits, but has its own
    OCDBT B-tree cache. Every step is a new OCDBT database, so a cache shared across steps
    only accumulates nodes nobody reads again (host memory growing checkpoint after
    checkpoint, up to the pool's limit); this one is released with the step."""
    return ts.Context({"cache_pool#ocdbt": _OCDBT_CACHE}, parent=shared)


def make_context(parent: ts.Context, *, file_io_concurrency: int = 128,
                 data_copy_concurrency: int | None = None,
                 request_retries: int | None = None) -> ts.Context:
    """A TensorStore context: I/O concurrency and an OCDBT B-tree cache.

    Reads use plain ``pread`` rather than ``file_io_mode: memmap``: memory-mapped reads were
    ~20% faster from the page cache but ~30% slower from disk (page-fault-driven readahead),
    and a restore after a failure usually reads from disk."""
    spec: dict[str, Any] = {
        "file_io_concurrency": {"limit": file_io_concurrency},
        "cache_pool#ocdbt": _OCDBT_CACHE,
    }
    if data_copy_concurrency:
        spec["data_copy_concurrency"] = {"limit": data_copy_concurrency}
    if request_retries is not None:  # object stores: fail in seconds, not after 32 retries
        retries = {"max_retries": int(request_retries), "initial_delay": "0.5s", "max_delay": "8s"}
        spec["s3_request_retries"] = retries
        spec["gcs_request_retries"] = retries
    return ts.Context(spec, parent=parent)


def ocdbt_spec(location: Location, rel_dir: str, *, write: bool = False,
               target_data_file_size: int | None = None) -> dict[str, Any]:
    """OCDBT kvstore spec for the database in ``rel_dir``.

    On local filesystems data files are written without tmp-file + rename (they are
    content-addressed and never overwritten: ``non_atomic`` saves a rename per file) while
    the manifest keeps atomic replacement, as Orbax does.
    """
    base = location.kvstore_spec(rel_dir)
    spec: dict[str, Any] = {"driver": "ocdbt", "base": base, "cache_pool": "cache_pool#ocdbt"}
    if base.get("driver") == "file":
        # Same base spec for reading and writing: OCDBT's copy_range (merge) requires it.
        spec["base"] = {**base, "file_io_locking": {"mode": "non_atomic"}}
        spec["manifest"] = base
    if write:
        spec["config"] = dict(OCDBT_CONFIG)
        spec["assume_config"] = True
        if target_data_file_size is not None:
            spec["target_data_file_size"] = int(target_data_file_size)
    return spec


@functools.lru_cache(maxsize=4096)
def create_spec(shape: tuple[int, ...], dtype: np.dtype, chunk_shape: tuple[int, ...],
               checksums: bool) -> ts.Spec:
    """The zarr3 spec that creates one array, without its kvstore (the step's database).

    Why cached: a checkpoint opens every leaf again in a new database, and parsing the spec
    from JSON was most of that (20 ms for 202 leaves against 6 ms from a parsed ``ts.Spec``,
    more beside training). A model's leaves repeat a few shapes, so the cache stays small.
    """
    return ts.Spec({
        "driver": "zarr3",
        "metadata": layout.zarr3_metadata(shape, dtype, chunk_shape, checksums=checksums),
        "create": True,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        # Write every chunk even if it equals the fill value: a missing chunk then always
        # means a lost chunk, which restore reports instead of silently returning zeros.
        "store_data_equal_to_fill_value": True,
    })


def write_process_shards(location: Location, item_rel: str, process_index: int,
                         arrays: Sequence[ArrayWrite], context: ts.Context, *, step: int,
                         batch_bytes: int, target_data_file_size: int,
                         alongside: Callable[[], None] = lambda: None) -> None:
    """Write this process's shards of every array; returns once all are durable.

    Every array gets its ``zarr.json`` (each process writes the same metadata, so the
    merged root holds one consistent copy), then every shard is written. ``alongside`` runs
    in this thread once the first commit is issued, while TensorStore writes the data: work
    that does not depend on the data (the primary's metadata files) then costs no time of
    its own. On failure, its or a write's, all writes already issued are awaited before
    raising, so nothing writes into a directory the caller is about to delete.
    """
    rel = f"{item_rel}/{layout.process_dir(process_index)}"
    location.make_dir(rel)
    kv = ocdbt_spec(location, rel, write=True, target_data_file_size=target_data_file_size)
    # The first transaction holds every zarr.json and the first ~batch_bytes of data:
    # one OCDBT commit (one fsync'd manifest update, a few large data files written in
    # parallel) per batch. Later batches overlap: the next one is staged while the previous
    # one is being written, two in flight at most. Staging only references host buffers.
    txn = ts.Transaction()
    database = ts.KvStore.open(kv, context=context).result()
    opens = [ts.open(create_spec(a.host.shape, a.host.dtype, a.chunk_shape, a.checksums),
                     kvstore=database / f"{a.name}/", context=context, transaction=txn) for a in arrays]
    commits: collections.deque = collections.deque()
    first_error: BaseException | None = None
    try:
        stores = [o.result() for o in opens]  # bound to the first transaction
        open_txn, staged, writes, first_batch = txn, 0, [], True
        for a, store in zip(arrays, stores):
            hooks.fire("array_write", step=step, array=a.name)
            # The parts of one block go in one transaction: a chunk they share is then
            # written once, not read back and rewritten by a later commit.
            for parts in a.host.shards_by_block():
                bound = store if txn is open_txn else store.with_transaction(txn)
                for shard in parts:
                    target = bound[shard.index] if shard.index else bound
                    writes.append(target.write(shard.data, can_reference_source_data_indefinitely=True))
                    staged += shard.nbytes
                if staged >= batch_bytes:
                    commits.append(_commit(txn, writes))
                    if first_batch:  # later batches rely on the committed zarr.json
                        alongside()
                        commits.popleft().result()
                        first_batch = False
                    while len(commits) > 1:
                        commits.popleft().result()
                    txn, staged, writes = ts.Transaction(), 0, []
        commits.append(_commit(txn, writes))
        if first_batch:
            alongside()
        while commits:
            commits.popleft().result()
    except BaseException as e:  # noqa: BLE001 - re-raised below after draining
        first_error = e
    finally:
        for fut in commits:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the first error is the one reported
                pass
    if first_error is not None:
        raise first_error


def _commit(txn: ts.Transaction, writes: list) -> ts.Future:
    """Commit ``txn`` once its writes are staged (they only reference the host buffers)."""
    for w in writes:
        w.copy.result()  # staging errors (e.g. dtype) surface here, before the commit
    return txn.commit_async()


def merge_into_root(location: Location, item_rel: str, context: ts.Context) -> list[str]:
    """Primary only: merge every ``ocdbt.process_*`` database into the item's root database.

    Only B-tree metadata is written; the root references the per-process data files, which
    must therefore never be deleted on their own. Returns the merged process directories.
    """
    process_dirs = [n for n in location.list_children(item_rel) if layout.is_process_dir(n)]
    if not process_dirs:
        raise FileNotFoundError(f"no {layout.PROCESS_PREFIX}* database under {location.describe(item_rel)}")
    parent = ts.KvStore.open(ocdbt_spec(location, item_rel, write=True), context=context).result()
    children = [ts.KvStore.open(ocdbt_spec(location, f"{item_rel}/{p}"), context=context).result()
                for p in process_dirs]
    if len(children) > 1:
        _check_same_array_metadata(children, process_dirs, location.describe(item_rel))
    txn = ts.Transaction(atomic=True)
    copies = [c.experimental_copy_range_to(parent.with_transaction(txn)) for c in children]
    for c in copies:
        c.result()
    txn.commit_async().result()
    return process_dirs


def _check_same_array_metadata(children: list[ts.KvStore], names: list[str], where: str) -> None:
    """Every process must have written identical zarr.json files (same shape, dtype, chunk
    grid); otherwise the merged root would describe some processes' chunks wrongly."""
    reference: dict[bytes, bytes] = {}
    for child, name in zip(children, names):
        keys = [k for k in child.list().result() if k.endswith(b"/zarr.json")]
        for key, value in zip(keys, [child.read(k) for k in keys]):
            data = value.result().value
            if reference.setdefault(key, data) != data:
                raise ValueError(
                    f"{where}: {name} wrote different array metadata for {key.decode()!r} than "
                    "another process; all processes must save the same tree with the same "
                    "global shapes, dtypes and shardings.")
