"""Host-side representation of one (possibly sharded) array of a checkpoint.

Why not a plain ``numpy.ndarray``: in a sharded or multi-process job a process only
holds its *addressable* shards, and each process must capture, replay and persist just
those. A :class:`HostArray` therefore keeps the global shape and dtype plus the list of
shards this process owns, each with its index into the global array. A single-device
array is simply a :class:`HostArray` with one shard covering everything.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

Index = tuple[slice, ...]


def full_index(shape: Sequence[int]) -> Index:
    """The index that selects the whole of an array of ``shape``."""
    return tuple(slice(0, n) for n in shape)


def normalize_index(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """Resolve ``slice(None)`` entries (as ``jax`` reports shard indices) to explicit
    bounds, so indices compare and hash by value. Strided indices never occur for shards."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


@dataclasses.dataclass
class HostShard:
    """One contiguous block of a global array held in host memory."""

    index: Index
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclasses.dataclass
class HostArray:
    """The addressable part of a global array, held in host memory.

    ``shards`` hold distinct blocks (replicas are deduplicated at capture time), so a
    writer can persist them independently and a reader can reassemble the array.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    shards: list[HostShard]

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> "HostArray":
        array = np.asarray(array)
        return cls(tuple(array.shape), array.dtype, [HostShard(full_index(array.shape), array)])

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def is_fully_addressable(self) -> bool:
        """True when the shards tile the whole array (single process)."""
        covered = sum(int(np.prod([s.stop - s.start for s in sh.index])) for sh in self.shards)
        return covered == int(np.prod(self.shape))

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
