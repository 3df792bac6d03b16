"""Host-side representation of one (possibly sharded) array of a checkpoint.

Why not a plain ``numpy.ndarray``: in a sharded or multi-process job a process only
holds its *addressable* shards, and each process must capture, replay and persist just
those. A :class:`HostArray` therefore keeps the global shape and dtype plus the list of
shards this process owns, each with its index into the global array. A single-device
array is simply a :class:`HostArray` with one shard covering everything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import numpy as np

Index = tuple[slice, ...]
IndexKey = tuple[tuple[int, int], ...]  # an Index as (start, stop) pairs: hashable before 3.12


def full_index(shape: Sequence[int]) -> Index:
    """The index that selects the whole of an array of ``shape``."""
    return tuple(slice(0, n) for n in shape)


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """Resolve ``slice(None)`` entries (as ``jax`` reports shard indices) to explicit
    bounds, so indices compare and hash by value. Strided indices never occur for shards."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def index_key(index: Sequence[slice]) -> IndexKey:
    """A normalized index as a hashable value (slices are unhashable before Python 3.12)."""
    return tuple((s.start, s.stop) for s in index)


def index_from_key(key: IndexKey) -> Index:
    return tuple(slice(a, b) for a, b in key)


def extent(index: Sequence[slice]) -> tuple[int, ...]:
    """The shape of the block an index selects."""
    return tuple(s.stop - s.start for s in index)


def covers(shape: Sequence[int], indices: Sequence[Sequence[slice]]) -> bool:
    """True when distinct blocks at ``indices`` tile an array of ``shape`` (single process)."""
    covered = sum(int(np.prod(extent(index))) for index in indices)
    return covered == int(np.prod(shape))


PART_BYTES = 1 << 20  # per block: see part_rows


def part_rows(block_shape: Sequence[int], itemsize: int) -> int:
    """The rows a row-chunked leaf with device blocks of ``block_shape`` is cut at multiples
    of (by the window's slices and the host replay's calls): about :data:`PART_BYTES` of each
    block for blocks of 4x that or more, else single rows.

    Why: the host copy hands each replayed leaf to storage as the rows each replay call
    keeps. TensorStore writes a zarr chunk that one such part covers straight from it, but
    assembles a chunk that two parts share in a copy: with cuts at any row, peak RSS was
    ~0.7x the state higher (a 228 MiB state of 4 MiB leaves, K=3, through CheckpointStore,
    whose 4 MiB chunks then each held several parts). Storage chunks by the parts' common
    row grid when it is this coarse (``overlap_ckpt.storage.tree.chunk_shape_for``). A
    function of the block alone, so that every process finds the same grid."""
    if not block_shape:
        return 1
    rows = int(block_shape[0])
    block_row = int(np.prod(block_shape[1:])) * itemsize
    if rows * block_row < 4 * PART_BYTES:
        return 1
    return min(rows, -(-PART_BYTES // max(block_row, 1)))


def replica0_owners(shape: Sequence[int], sharding: Any) -> list[tuple[Index, int]]:
    """Every distinct block of an array of ``shape`` placed by the jax ``sharding`` with the
    process that holds its replica 0, in index order: the same list on every process (jax
    numbers the replicas of a block in the order of ``devices_indices_map``, so replica 0
    is the first device listed for it)."""
    owners: dict[IndexKey, tuple[Index, int]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        index = normalize_index(index, shape)
        owners.setdefault(index_key(index), (index, device.process_index))
    return [owners[k] for k in sorted(owners)]


def sharding_blocks(shape: Sequence[int], sharding: Any) -> list[Index]:
    """Every distinct block of an array of ``shape`` placed by ``sharding``, on all
    processes, in index order."""
    return [index for index, _ in replica0_owners(shape, sharding)]


def is_prng_key(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``), whose dtype numpy cannot hold."""
    import jax
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def local_blocks(x: Any) -> Iterator[tuple[Index, Any]]:
    """``(global index, device data)`` of each distinct block of ``x`` this process holds:
    replica 0 of every shard, so a replicated array yields one block, not one per device."""
    seen: set[IndexKey] = set()
    for shard in x.addressable_shards:
        index = normalize_index(shard.index, x.shape)
        key = index_key(index)
        if shard.replica_id != 0 or key in seen:
            continue
        seen.add(key)
        yield index, shard.data


@dataclasses.dataclass
class HostShard:
    """One contiguous block of a global array held in host memory."""

    index: Index
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def _containing(blocks: Sequence[Index], index: Index) -> int:
    for i, block in enumerate(blocks):
        if all(b.start <= s.start and s.stop <= b.stop for b, s in zip(block, index)):
            return i
    raise ValueError(f"shard {index} lies in none of the blocks {list(blocks)}")


@dataclasses.dataclass
class HostArray:
    """The addressable part of a global array, held in host memory.

    ``shards`` hold distinct blocks (replicas are deduplicated at capture time), so a
    writer can persist them independently and a reader can reassemble the array.

    ``blocks``, when given, are the blocks of the array's layout that the shards tile, each
    by one shard or by several *parts* (the host replay keeps a leaf as the row ranges of
    its calls' outputs). Storage chooses chunks from the blocks, not the parts: chunks
    that tile the parts would shrink to the rows' greatest common divisor.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    shards: list[HostShard]
    blocks: tuple[Index, ...] | None = None
    # The jax sharding whose replica-0 blocks ``blocks`` are (the window's capture layout),
    # when known: a local-tier restore rebuilds the leaf from every process's blocks with it
    # (overlap_ckpt.tiers.restore), whatever the layout it is restored onto.
    sharding: Any = None

    @property
    def layout_indices(self) -> list[Index]:
        """The indices storage tiles: the layout's blocks where known, else the shards'."""
        return list(self.blocks) if self.blocks is not None else [s.index for s in self.shards]

    def shards_by_block(self) -> list[list[HostShard]]:
        """The shards grouped by the layout block that holds them (one group per shard
        without ``blocks``), so that a writer keeps the parts of one block together."""
        if self.blocks is None:
            return [[s] for s in self.shards]
        groups: list[list[HostShard]] = [[] for _ in self.blocks]
        for shard in self.shards:
            groups[_containing(self.blocks, shard.index)].append(shard)
        return [g for g in groups if g]

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "HostArray":
        array = np.asarray(array)
        return cls(tuple(array.shape), array.dtype, [HostShard(full_index(array.shape), array)])

    @classmethod
    def from_jax(cls, x: Any, *, copy: bool, where: str = "leaf") -> "HostArray":
        """This process's blocks of the jax.Array ``x`` in host memory.

        ``copy=True`` gives buffers that own their memory, for arrays a later step may
        donate; ``copy=False`` views host-resident data where numpy can (CPU and pinned-host
        arrays). Typed PRNG keys are refused: numpy has no dtype for them.
        """
        if is_prng_key(x):
            raise TypeError(f"{where}: a typed PRNG key array cannot be stored as is; store "
                            "jax.random.key_data(key) and wrap it again after restore.")
        shards = [HostShard(index, np.array(data, copy=True) if copy else np.asarray(data))
                  for index, data in local_blocks(x)]
        return cls(tuple(x.shape), np.dtype(x.dtype), shards, sharding=x.sharding)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def is_fully_addressable(self) -> bool:
        """True when the shards tile the whole array (single process)."""
        return covers(self.shape, [s.index for s in self.shards])

    def to_numpy(self) -> np.ndarray:
        """Assemble the global array; only valid when this process holds all of it."""
        if not self.is_fully_addressable:
            raise ValueError(
                f"HostArray of shape {self.shape} holds only part of the array in this "
                "process; assemble it across processes with a restore onto a target sharding.")
        if len(self.shards) == 1:
            return self.shards[0].data
        out = np.empty(self.shape, self.dtype)
        for shard in self.shards:
            out[shard.index] = shard.data
        return out
