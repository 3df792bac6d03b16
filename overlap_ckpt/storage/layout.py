"""On-disk layout: names, and building / validating every metadata file (see docs/format.md).

The layout is the one Orbax 0.12 writes for ``CheckpointManager`` + ``StandardSave``, so
stock Orbax restores our checkpoints and we restore Orbax's::

    <root>/<step>/                         committed step (local: renamed from the tmp name)
    <root>/<step>.orbax-checkpoint-tmp/     step being written (or left by a crash)
        _CHECKPOINT_METADATA                step metadata; user metadata in custom_metadata
        commit_success.txt                  commit marker (the commit itself on object stores)
        default/                            the item
            _METADATA                       Orbax tree metadata (key paths, value types)
            _overlap_ckpt.json              our manifest: format version, shapes, dtypes, chunks
            manifest.ocdbt, d/...           merged OCDBT root (written by the primary)
            ocdbt.process_<i>/              OCDBT database of process i: zarr3 arrays
                manifest.ocdbt, d/...

Everything parsed here comes from disk and is validated: sizes, types, names, and that no
name can address a path outside the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

from .errors import InvalidMetadataError
from .tree import ARRAY_VALUE_TYPES, EMPTY_VALUE_TYPES, KEY_DICT, KEY_SEQUENCE, Leaf

# 2: arrays may be written without crc32c (the manifest's "crc32c": false). A manifest whose
# arrays all have it is still written as 1, which every release reads; a release that reads
# only 1 then refuses the others with "upgrade", not with "lost its crc32c codec".
FORMAT_VERSION = 2
ITEM_NAME = "default"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
DELETING_SUFFIX = TMP_SUFFIX + "-deleting"
COMMIT_MARKER = "commit_success.txt"
STEP_METADATA = "_CHECKPOINT_METADATA"
TREE_METADATA = "_METADATA"
MANIFEST = "_overlap_ckpt.json"
PROCESS_PREFIX = "ocdbt.process_"
STANDARD_HANDLER = ("orbax.checkpoint._src.handlers.standard_checkpoint_handler."
                    "StandardCheckpointHandler")

MAX_METADATA_BYTES = 256 << 20

_STEP_RE = re.compile(r"^(\d+)$")
_TMP_RE = re.compile(r"^(\d+)" + re.escape(TMP_SUFFIX) + r"(?:[-.].*)?$")
_PROCESS_RE = re.compile(r"^ocdbt\.process_(?:replica_)?[A-Za-z0-9]+$")
# Array names are OCDBT keys and, in non-OCDBT Orbax layouts, directory names.
_BAD_NAME_CHARS = re.compile(r"[/\\\x00-\x1f]")


def step_dir(step: int) -> str:
    return str(step)


def tmp_dir(step: int) -> str:
    return f"{step}{TMP_SUFFIX}"


def parse_step_name(name: str) -> tuple[int, bool] | None:
    """``(step, is_final_name)`` for a step directory name, ``None`` for anything else."""
    m = _STEP_RE.match(name)
    if m:
        return int(m.group(1)), True
    m = _TMP_RE.match(name)
    if m:
        return int(m.group(1)), False
    return None


def is_process_dir(name: str) -> bool:
    return bool(_PROCESS_RE.match(name))


def process_dir(process_index: int) -> str:
    return f"{PROCESS_PREFIX}{process_index}"


def validate_array_name(name: str, where: str = "") -> str:
    """Refuse names that could escape the item directory (they are OCDBT keys, and directory
    names in Orbax's non-OCDBT layout)."""
    if not isinstance(name, str) or not name or _BAD_NAME_CHARS.search(name) or name in (".", ".."):
        raise InvalidMetadataError(
            f"Array name {name!r}{' (' + where + ')' if where else ''} is not allowed: names "
            "are the tree's keys joined by '.' and may not be empty, '.', '..', or contain "
            "'/', '\\' or control characters. Rename the key.")
    return name


# -- JSON helpers -------------------------------------------------------------------------

def dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, allow_nan=False).encode()


def loads(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise InvalidMetadataError(f"{what} is not valid JSON ({e}); the file is corrupt or "
                                   "truncated: restore another step.", path=what) from e


def _require(cond: bool, what: str, detail: str) -> None:
    if not cond:
        raise InvalidMetadataError(f"{what} is malformed: {detail}. The checkpoint is corrupt or "
                                   "was written by an incompatible tool.", path=what)


# -- _METADATA (Orbax tree metadata) ----------------------------------------------------------

def tree_metadata(leaves: Sequence[Leaf]) -> dict[str, Any]:
    """Orbax's ``_METADATA`` JSON for the flattened tree."""
    entries = {}
    for leaf in leaves:
        value: dict[str, Any] = {"value_type": leaf.value_type,
                                 "skip_deserialize": not leaf.is_array}
        entries[str(leaf.keys)] = {
            "key_metadata": [{"key": k, "key_type": t} for k, t in zip(leaf.keys, leaf.key_types)],
            "value_metadata": value,
        }
    return {"tree_metadata": entries, "use_ocdbt": True, "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


@dataclasses.dataclass
class SavedLeaf:
    keys: tuple[str, ...]
    key_types: tuple[int, ...]
    value_type: str

    @property
    def name(self) -> str:
        return ".".join(self.keys)

    @property
    def is_array(self) -> bool:
        return self.value_type not in EMPTY_VALUE_TYPES


@dataclasses.dataclass
class TreeMetadata:
    leaves: list[SavedLeaf]
    use_ocdbt: bool | None
    use_zarr3: bool
    data_complete: bool  # store_array_data_equal_to_fill_value: every chunk was written


def parse_tree_metadata(raw: bytes, what: str) -> TreeMetadata:
    doc = loads(raw, what)
    _require(isinstance(doc, dict), what, "top level is not an object")
    entries = doc.get("tree_metadata")
    _require(isinstance(entries, dict) and entries, what, "'tree_metadata' is missing or empty")
    leaves = []
    names = set()
    for label, entry in entries.items():
        _require(isinstance(entry, dict), what, f"entry {label!r} is not an object")
        km, vm = entry.get("key_metadata"), entry.get("value_metadata")
        _require(isinstance(km, list) and km, what, f"entry {label!r} has no key_metadata")
        _require(isinstance(vm, dict), what, f"entry {label!r} has no value_metadata")
        keys, types = [], []
        for k in km:
            _require(isinstance(k, dict) and isinstance(k.get("key"), (str, int))
                     and k.get("key_type") in (KEY_SEQUENCE, KEY_DICT), what,
                     f"bad key entry {k!r} in {label!r}")
            keys.append(str(k["key"]))
            types.append(int(k["key_type"]))
        vt = vm.get("value_type")
        _require(isinstance(vt, str), what, f"entry {label!r} has no value_type")
        if vt not in ARRAY_VALUE_TYPES and vt not in EMPTY_VALUE_TYPES:
            raise InvalidMetadataError(
                f"{what}: leaf {label} has value type {vt!r}, which overlap_ckpt cannot restore "
                f"(supported: {', '.join(ARRAY_VALUE_TYPES + EMPTY_VALUE_TYPES)}). Restore this "
                "step with Orbax itself.", path=what)
        leaf = SavedLeaf(tuple(keys), tuple(types), vt)
        if leaf.is_array:
            validate_array_name(leaf.name, f"in {what}")
            _require(leaf.name not in names, what, f"two arrays are named {leaf.name!r}")
            names.add(leaf.name)
        leaves.append(leaf)
    use_ocdbt = doc.get("use_ocdbt")
    use_zarr3 = doc.get("use_zarr3", False)
    _require(use_ocdbt is None or isinstance(use_ocdbt, bool), what, "use_ocdbt is not a bool")
    _require(isinstance(use_zarr3, bool), what, "use_zarr3 is not a bool")
    complete = doc.get("store_array_data_equal_to_fill_value", False)
    return TreeMetadata(leaves, use_ocdbt, use_zarr3, bool(complete))


# -- _CHECKPOINT_METADATA (Orbax step metadata) ---------------------------------------------

def step_metadata(custom: dict | None, init_ns: int, item: str = ITEM_NAME) -> dict[str, Any]:
    return {"item_handlers": {item: STANDARD_HANDLER}, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": init_ns, "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": custom or {}}


def parse_step_metadata(raw: bytes, what: str) -> dict[str, Any]:
    doc = loads(raw, what)
    _require(isinstance(doc, dict), what, "top level is not an object")
    custom = doc.get("custom_metadata") or {}
    _require(isinstance(custom, dict), what, "custom_metadata is not an object")
    return doc


# -- zarr3 array metadata ---------------------------------------------------------------------

def zarr_dtype(dtype: np.dtype) -> str:
    """zarr3 ``data_type`` for a numpy dtype (``bfloat16`` etc. via TensorStore's names)."""
    try:
        return ts.dtype(np.dtype(dtype)).name
    except (TypeError, ValueError) as e:
        raise TypeError(f"dtype {dtype} cannot be stored by TensorStore/zarr3.") from e


def numpy_dtype(name: str, what: str) -> np.dtype:
    try:
        return ts.dtype(name).numpy_dtype
    except (TypeError, ValueError) as e:
        raise InvalidMetadataError(f"{what}: unknown data type {name!r}.", path=what) from e


def zarr3_metadata(shape: Sequence[int], dtype: np.dtype, chunk_shape: Sequence[int], *,
                   checksums: bool = True) -> dict[str, Any]:
    """zarr3 array metadata: raw little-endian bytes plus, with ``checksums``, a crc32c per
    chunk; no compression.

    Why no compression: model weights are high-entropy floats; zstd buys a few percent of
    space for a large share of the persist time. The crc32c codec makes every chunk
    self-verifying: TensorStore checks it on each read (restore and verify).
    """
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [int(n) for n in shape],
        "data_type": zarr_dtype(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [int(c) for c in chunk_shape]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if np.dtype(dtype) == np.bool_ else 0,
        "codecs": codecs + [{"name": "crc32c"}] if checksums else codecs,
    }


def has_crc32c(store: ts.TensorStore) -> bool:
    """Whether an opened array's chunks carry a crc32c (ours by default; not Orbax's, nor
    ours written with ``checksums=False``), which TensorStore then checks on every read."""
    return "crc32c" in str(store.codec.to_json())


#: No array of a checkpoint may claim more bytes than this (1 PiB): larger shapes come from
#: crafted or corrupt metadata and are refused before any allocation.
MAX_ARRAY_BYTES = 1 << 50


# -- our manifest -----------------------------------------------------------------------------

@dataclasses.dataclass
class ArrayRecord:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_shape: tuple[int, ...]
    # Written with a crc32c per chunk: restore then refuses the array if its zarr.json lost
    # the codec. Manifests from before the store's ``checksums`` option always had them.
    checksummed: bool = True

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def manifest(step: int, arrays: Sequence[ArrayRecord], process_count: int) -> dict[str, Any]:
    return {
        "format": "overlap_ckpt",
        "format_version": 1 if all(a.checksummed for a in arrays) else FORMAT_VERSION,
        "step": step,
        "process_count": process_count,
        "arrays": {a.name: {"shape": list(a.shape), "dtype": zarr_dtype(a.dtype),
                            "chunk_shape": list(a.chunk_shape), "crc32c": a.checksummed} for a in arrays},
    }


def parse_manifest(raw: bytes, what: str) -> dict[str, ArrayRecord]:
    doc = loads(raw, what)
    _require(isinstance(doc, dict) and doc.get("format") == "overlap_ckpt", what,
             "not an overlap_ckpt manifest")
    version = doc.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise InvalidMetadataError(
            f"{what} has format_version {version!r}; this overlap_ckpt reads up to "
            f"{FORMAT_VERSION}. Upgrade overlap_ckpt to restore it.", path=what)
    arrays = doc.get("arrays")
    _require(isinstance(arrays, dict), what, "'arrays' is not an object")
    out = {}
    for name, spec in arrays.items():
        validate_array_name(name, f"in {what}")
        _require(isinstance(spec, dict), what, f"array {name!r} is not an object")
        shape, chunk = spec.get("shape"), spec.get("chunk_shape")
        _require(_int_list(shape) and _int_list(chunk) and len(shape) == len(chunk), what,
                 f"array {name!r} has a bad shape/chunk_shape")
        _require(isinstance(spec.get("dtype"), str), what, f"array {name!r} has no dtype")
        checksummed = spec.get("crc32c", True)
        _require(isinstance(checksummed, bool), what, f"array {name!r} has a non-boolean crc32c")
        out[name] = ArrayRecord(name, tuple(shape), numpy_dtype(spec["dtype"], what), tuple(chunk),
                                checksummed)
    return out


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                       for n in x)


def check_zarr_spec(name: str, store: ts.TensorStore, record: ArrayRecord | None, what: str) -> None:
    """Validate an opened array against the manifest (shape, dtype), and refuse absurd sizes
    (crafted or corrupt metadata) before anything is allocated for it."""
    nbytes = math.prod(int(n) for n in store.shape) * store.dtype.numpy_dtype.itemsize
    if nbytes > MAX_ARRAY_BYTES:
        raise InvalidMetadataError(
            f"{what}: array {name!r} claims shape {tuple(store.shape)} {store.dtype.name} "
            f"({nbytes} bytes, over the {MAX_ARRAY_BYTES}-byte sanity limit); its metadata is "
            "corrupt or crafted. Restore another step.", path=what)
    if record is None:
        return
    if tuple(store.shape) != record.shape or store.dtype.numpy_dtype != record.dtype:
        raise InvalidMetadataError(
            f"{what}: array {name!r} is stored as {tuple(store.shape)} {store.dtype.name} but the "
            f"manifest says {record.shape} {record.dtype}; the checkpoint was modified after "
            "it was written.", path=what)
