"""Flattening train-state pytrees into named leaves, the way Orbax names them.

Why Orbax's naming: stock Orbax must restore our checkpoints, so a leaf at key path
``('opt', 1, 0, 'mu', 'w')`` must be stored under the array name ``opt.1.0.mu.w`` and
described in ``_METADATA`` with the same key types Orbax uses (dict-like keys = 2,
sequence keys = 1). Empty nodes (``None``, ``{}``, ``[]``, ``()``, ``optax.EmptyState()``,
``optax.MaskedNode()``) are kept as leaves so that the saved structure is complete.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import jax
import numpy as np

from ..gil import yielding
from ..hostarray import HostArray, HostShard, extent, normalize_index, part_rows, sharding_blocks

KEY_SEQUENCE = 1
KEY_DICT = 2

# Orbax value types (``value_metadata.value_type`` in ``_METADATA``).
VT_ARRAY = "np.ndarray"
VT_JAX = "jax.Array"
VT_SCALAR = "scalar"
VT_NONE, VT_DICT, VT_LIST, VT_TUPLE = "None", "Dict", "List", "Tuple"
EMPTY_VALUE_TYPES = (VT_NONE, VT_DICT, VT_LIST, VT_TUPLE, "NamedTuple")
ARRAY_VALUE_TYPES = (VT_ARRAY, VT_JAX, VT_SCALAR)


def key_name_and_type(key: Any) -> tuple[str, int]:
    """Orbax's name and key type for one JAX key-path entry."""
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx), KEY_SEQUENCE
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key), KEY_DICT
    if isinstance(key, jax.tree_util.GetAttrKey):
        return str(key.name), KEY_DICT
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key), KEY_SEQUENCE
    raise TypeError(f"Unsupported pytree key {key!r} ({type(key).__name__}); register the node "
                    "with keys (jax.tree_util.register_pytree_with_keys).")


def path_str(keypath: Sequence[Any]) -> str:
    """Human-readable leaf path for error messages, e.g. ``opt_state[1].mu['w']``."""
    return jax.tree_util.keystr(tuple(keypath)) or "<root>"


def is_empty_node(x: Any) -> bool:
    """True for pytree nodes without children (``None``, ``{}``, ``EmptyState()``...)."""
    if _is_array_like(x):
        return False
    children = jax.tree_util.tree_leaves(x, is_leaf=lambda y: y is not x)
    return not children


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic, HostArray, jax.Array)) or (
        isinstance(x, numbers.Number))


def empty_value_type(x: Any) -> str:
    """Orbax's type string for an empty node (NamedTuples are written as "None", as Orbax does)."""
    if x is None:
        return VT_NONE
    if isinstance(x, list):
        return VT_LIST
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return VT_TUPLE
    if isinstance(x, dict):
        return VT_DICT
    return VT_NONE


@dataclasses.dataclass
class Leaf:
    """One flattened leaf: key path (names + Orbax key types) and its value."""

    keys: tuple[str, ...]
    key_types: tuple[int, ...]
    display: str
    value_type: str
    value: HostArray | None  # None for empty nodes

    @property
    def name(self) -> str:
        """Array name inside the checkpoint (Orbax: keys joined by ``.``)."""
        return ".".join(self.keys)

    @property
    def is_array(self) -> bool:
        return self.value is not None


def flatten(tree: Any) -> list[tuple[tuple, Any]]:
    """(keypath, leaf) pairs with empty nodes kept as leaves."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty_node)
    return flat


def to_leaves(tree: Any) -> list[Leaf]:
    """Flatten a tree to be saved, converting every array leaf to a :class:`HostArray`.

    Raises ``TypeError`` naming the leaf path for values that cannot be checkpointed.
    """
    leaves = []
    for keypath, value in yielding(flatten(tree)):
        pairs = [key_name_and_type(k) for k in keypath]
        keys = tuple(p[0] for p in pairs)
        types = tuple(p[1] for p in pairs)
        display = path_str(keypath)
        if is_empty_node(value):
            leaves.append(Leaf(keys, types, display, empty_value_type(value), None))
            continue
        value_type = VT_ARRAY
        if isinstance(value, (bool, int, float, complex)) and not isinstance(value, np.generic):
            value_type = VT_SCALAR
        leaves.append(Leaf(keys, types, display, value_type, as_host_array(value, display)))
    if not leaves:
        raise ValueError("Cannot checkpoint an empty tree: there is nothing to restore later.")
    return leaves


def as_host_array(value: Any, where: str = "leaf") -> HostArray:
    """A :class:`HostArray` view of ``value`` (no copy for numpy and CPU jax arrays)."""
    if isinstance(value, HostArray):
        return _checked(value, where)
    if isinstance(value, jax.Array):
        return _checked(HostArray.from_jax(value, copy=False, where=where), where)
    if isinstance(value, (np.ndarray, np.generic, bool, int, float, complex)):
        array = np.asarray(value)
        if array.dtype.kind in "OUSMm":
            raise TypeError(f"{where}: dtype {array.dtype} cannot be stored in a checkpoint; "
                            "store numbers only (put strings in the metadata dict).")
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        return HostArray.from_numpy(array)
    raise TypeError(f"{where}: unsupported leaf type {type(value).__name__}. Leaves must be "
                    "HostArray, numpy arrays/scalars, Python numbers or host jax Arrays.")


def _checked(host: HostArray, where: str) -> HostArray:
    shape = tuple(int(n) for n in host.shape)
    dtype = np.dtype(host.dtype)
    shards = []
    for shard in host.shards:
        index = normalize_index(shard.index, shape)
        data = np.asarray(shard.data)
        if data.shape != extent(index) or data.dtype != dtype:
            raise ValueError(f"{where}: shard {index} holds {data.shape} {data.dtype}, expected "
                             f"{extent(index)} {dtype} for a HostArray of shape {shape}.")
        shards.append(HostShard(index, data))
    blocks = None if host.blocks is None else tuple(normalize_index(b, shape) for b in host.blocks)
    return HostArray(shape, dtype, shards, blocks, host.sharding)


# -- chunking ---------------------------------------------------------------------------

def chunk_shape_for(host: HostArray, chunk_bytes: int) -> tuple[int, ...]:
    """The chunk shape of ``host``: tiling its shards, or, for a leaf handed over in parts
    of its blocks (the host replay's calls' rows), tiling the parts when their common grid
    gives chunks at least 1/8 of what the blocks' would, else tiling the blocks.

    Why: TensorStore writes a chunk that one part covers straight from the host copy, but
    assembles a chunk that several parts share in a copy it holds until the commit (the
    replay cuts its parts at coarse rows to allow this, see
    :func:`overlap_ckpt.hostarray.part_rows`). Parts cut at any row would otherwise give
    chunks of their rows' greatest common divisor, down to one row."""
    itemsize = host.dtype.itemsize
    if host.sharding is not None and not host.sharding.is_fully_addressable:
        return _agreed_chunk_shape(host, chunk_bytes)
    by_parts = choose_chunk_shape(host.shape, itemsize, [s.index for s in host.shards], chunk_bytes)
    if host.blocks is None:
        return by_parts
    by_blocks = choose_chunk_shape(host.shape, itemsize, host.blocks, chunk_bytes)
    return by_parts if 8 * math.prod(by_parts) >= math.prod(by_blocks) else by_blocks


def _agreed_chunk_shape(host: HostArray, chunk_bytes: int) -> tuple[int, ...]:
    """The chunk shape of a leaf several processes write: every process must declare the
    same one (each writes the array's metadata into its own database, and the merge refuses
    two), yet each holds other blocks and parts of it, or none. So it is found from what
    all share: every block of the sharding, cut at the rows the host replay cuts parts at
    (:func:`overlap_ckpt.hostarray.part_rows`, a function of the block), which also tiles
    every process's parts."""
    shape = tuple(host.shape)
    if not shape:
        return ()
    blocks = sharding_blocks(shape, host.sharding)
    step = part_rows(tuple(host.sharding.shard_shape(shape)), host.dtype.itemsize)
    cut = [(slice(r, min(r + step, b[0].stop)), *b[1:]) for b in blocks for r in range(b[0].start, b[0].stop, step)]
    return choose_chunk_shape(shape, host.dtype.itemsize, cut, chunk_bytes)


def choose_chunk_shape(shape: Sequence[int], itemsize: int, shard_indices: Sequence[Sequence[slice]],
                       target_bytes: int) -> tuple[int, ...]:
    """Chunk shape that tiles every shard and holds at most ~``target_bytes``.

    Why tile the shards: in a multi-process job two processes must never write the same
    chunk (each writes its own OCDBT database), so chunk boundaries must fall on shard
    boundaries. Within that constraint chunks are split along the outermost axes (so a
    chunk is a contiguous block of a C-ordered shard and can be written without a copy)
    until they are at most ``target_bytes``; smaller chunks also let a restore onto a
    different sharding read less data it does not need.
    """
    shape = [int(n) for n in shape]
    if not shape:
        return ()
    # Per axis, the largest size that divides every shard start/extent (the shard grid).
    grid = []
    for d, n in enumerate(shape):
        g = 0
        for index in shard_indices:
            sl = index[d]
            g = math.gcd(g, sl.start)
            g = math.gcd(g, sl.stop - sl.start)
        grid.append(max(1, g if g else n))
    chunk = list(grid)
    for d in range(len(shape)):
        nbytes = itemsize * math.prod(chunk)
        if nbytes <= target_bytes:
            break
        rest = nbytes // chunk[d]  # bytes of one slab along axis d
        want = max(1, target_bytes // max(1, rest))
        if grid[d] >= shape[d]:
            # One shard spans this axis: any split is shard-aligned (edge chunk may be partial).
            pieces = math.ceil(chunk[d] / want)
            chunk[d] = math.ceil(chunk[d] / pieces)
        else:
            chunk[d] = _largest_divisor_at_most(chunk[d], want)
    return tuple(max(1, c) for c in chunk)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= limit:
                    best = d
        i += 1
    return best
