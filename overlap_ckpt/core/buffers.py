"""Host copies of a train state: blocks allocated once, and the copy of captured pieces in.

A :class:`HostBuffers` holds every block this process keeps of every leaf (replica 0 of
each shard), keyed by its global index. Captured pieces arrive as pinned-host jax Arrays
whose shards are row ranges of those blocks (:func:`store_piece`), or whole leaves in
whatever layout XLA returned them (:func:`store_whole`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..errors import WindowAborted
from ..gil import yielding
from ..hostarray import HostArray, HostShard, IndexKey, extent, index_from_key, index_key, normalize_index
from .packing import Captured, CapturedShard
from .plan import CapturePlan, LeafLayout
from .slicing import Piece

BlockKey = IndexKey

# The usual reason captured shards are not where a plan expects them, and the fix.
MOVED = ("The leaf is placed otherwise than when the window was planned (jit without "
         "out_shardings moves leaves after the first step): CheckpointManager re-plans at every "
         "window; with OverlapEngine, call plan_for(params, opt_state, extras) at phase 0 of each.")


class LeafBlocks:
    """The host blocks of one leaf, by global index key.

    A block is either *owned* (allocated here on first write, kept and reused across
    windows: copying into memory already touched avoids a page fault per page) or
    *adopted*: a read-only view of a captured host array that no replay will write (the
    last slice of a window, shared leaves and extras at the last phase). Adopting hands
    the captured copy to storage as is, saving one full copy of it; with K=1 no block is
    ever copied. With row chunks an adopted view may be a part of a block (the last
    slice's rows of a leaf cut between slices): the other rows are replay outputs (see
    :class:`overlap_ckpt.core.replay.WindowReplay`), and no block is owned.
    """

    def __init__(self, layout: LeafLayout):
        self.layout = layout
        self._owned: dict[BlockKey, np.ndarray] = {}
        self._adopted: dict[BlockKey, np.ndarray] = {}

    def __getitem__(self, key: BlockKey) -> np.ndarray:
        """The owned block to read or write (allocated on first use)."""
        if key in self._adopted:
            raise WindowAborted(f"host block {key} of a leaf of shape {self.layout.shape} was handed over "
                                "as captured and cannot be written")
        block = self._owned.get(key)
        if block is None:
            block = self._owned[key] = aligned_zeros(extent(index_from_key(key)), self.layout.dtype)
        return block

    def adopt(self, key: BlockKey, data: np.ndarray) -> None:
        """Keep ``data``, the captured values at global index ``key`` (a block or rows of one)."""
        self._adopted[key] = data

    def parts(self) -> list[HostShard]:
        """What this copy holds of the leaf: the adopted views, and the owned blocks not
        adopted in this window (a block adopted now may have been copied in an earlier one)."""
        owned = [(key, data) for key, data in self._owned.items() if key not in self._adopted]
        return [HostShard(index_from_key(key), data) for key, data in (*owned, *self._adopted.items())]

    def release_views(self) -> int:
        """Drop the adopted views; returns their bytes."""
        released = self.adopted_bytes
        self._adopted.clear()
        return released

    @property
    def owned_bytes(self) -> int:
        return sum(b.nbytes for b in self._owned.values())

    @property
    def adopted_bytes(self) -> int:
        return sum(b.nbytes for b in self._adopted.values())


class HostBuffers:
    """One host copy of a train state: every block this process keeps (see :class:`LeafBlocks`)
    and, with row chunks, the outputs of the replay calls, which hold the replayed rows.

    ``calls`` maps each replay call (slice, call number) to the output arrays of its last
    run: the replay donates them to the same call at the next phase, which then runs in
    place, and a later window's first run of that call writes into them again (the copy
    is reused through :class:`overlap_ckpt.core.engine.BufferPool`).
    """

    def __init__(self, plan: CapturePlan):
        self.plan = plan
        self.params = [LeafBlocks(l) for l in plan.params]
        self.state = [LeafBlocks(l) for l in plan.state]
        self.extras = [LeafBlocks(l) for l in plan.extras]
        self.calls: dict[tuple[int, int], list[jax.Array]] = {}

    def leaves(self):
        return (*self.params, *self.state, *self.extras)

    def release_views(self) -> int:
        """Drop adopted views (before reuse: the captured arrays may then be freed); returns
        their bytes."""
        return sum(leaf.release_views() for leaf in yielding(self.leaves()))

    @property
    def nbytes(self) -> int:
        """Host memory this copy owns: its blocks and its replay calls' outputs."""
        return (sum(leaf.owned_bytes for leaf in self.leaves())
                + sum(x.nbytes for outs in self.calls.values() for x in outs))

    @property
    def adopted_bytes(self) -> int:
        return sum(leaf.adopted_bytes for leaf in self.leaves())

    @property
    def held_bytes(self) -> int:
        """Host memory this copy keeps alive: its own blocks and the captures it adopted."""
        return self.nbytes + self.adopted_bytes


XLA_ALIGNMENT = 64  # bytes: XLA:CPU takes a numpy array as a buffer without copying only at this alignment


def aligned_zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros whose data starts on an :data:`XLA_ALIGNMENT` boundary.

    Why: the host replay passes row views of these blocks to a CPU-jitted update. numpy
    aligns to 16 bytes, and JAX then copies every input before the call; aligned, it
    reads the block in place (measured: a replay call of 15 MB took 4-8 ms from numpy's
    allocation, 1.4-2 ms from JAX's own buffers).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.zeros(nbytes + XLA_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % XLA_ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def trim_host_memory() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Why: a captured host copy is allocated by XLA in pieces below glibc's mmap threshold,
    so freeing it leaves the pages in malloc's arenas: measured on the 20M LM, RSS stayed
    one state copy higher after every persisted checkpoint (1140 MiB -> 702 MiB after a
    trim). Trimming right after a copy is released keeps host memory at the budget.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def host_array(blocks: LeafBlocks, replayed: list[HostShard] = ()) -> HostArray:
    """The leaf as storage takes it: the blocks' parts and the ``replayed`` rows, which must
    tile this process's blocks exactly (a gap would be saved as zeros)."""
    layout = blocks.layout
    shards = sorted([*blocks.parts(), *replayed], key=lambda s: index_key(s.index))
    held = sum(int(np.prod(s.data.shape)) for s in shards)
    want = sum(int(np.prod(extent(b))) for b in layout.blocks)
    if held != want:
        raise WindowAborted(f"the host copy of a leaf of shape {layout.shape} holds {held} of its "
                            f"{want} elements; a window phase is missing")
    return HostArray(layout.shape, layout.dtype, shards, tuple(layout.blocks), layout.sharding)


def replicated_value(x: jax.Array, shape: tuple[int, ...]) -> np.ndarray:
    """The value of a replicated (scalar-like) array of ``shape`` from this process's first
    copy (without the leading unit axes a capture may have added, see :func:`unlead`)."""
    return np.asarray(x.addressable_shards[0].data).reshape(shape)


def unlead(captured: jax.Array, ndim: int) -> Any:
    """``captured`` without the leading unit axes :func:`overlap_ckpt.core.capture.to_host`
    put in front of a host copy of ``ndim`` dimensions: its blocks as numpy views."""
    lead = len(captured.shape) - ndim
    if lead <= 0:
        return captured
    shards = [CapturedShard(normalize_index(s.index, captured.shape)[lead:],
                            np.asarray(s.data).reshape(s.data.shape[lead:]))
              for s in captured.addressable_shards if s.replica_id == 0]
    return Captured(tuple(captured.shape[lead:]), np.dtype(captured.dtype), shards)


def store_piece(blocks: LeafBlocks, captured: jax.Array, piece: Piece, *, adopt: bool = False) -> None:
    """Copy a captured piece (pinned-host array) into the host blocks it belongs to; with
    ``adopt``, the piece is kept as views instead (whole blocks, or rows of blocks)."""
    layout = blocks.layout
    captured = unlead(captured, len(layout.shape))
    if piece.start == 0 and piece.stop == layout.rows and tuple(captured.shape) == layout.shape:
        store_whole(blocks, captured, adopt=adopt)
        return
    for shard in captured.addressable_shards:
        if shard.replica_id != 0:
            continue
        block = layout.block_of(normalize_index(shard.index, captured.shape), piece)
        if adopt:
            blocks.adopt(index_key(rows_of(block, piece)), np.asarray(shard.data))
            continue
        dest = blocks[index_key(block)]
        if layout.shape:
            dest = dest[piece.start:piece.stop]
        np.copyto(dest, np.asarray(shard.data), casting="no")


def rows_of(block: tuple[slice, ...], rows: Piece) -> tuple[slice, ...]:
    """The global index of rows ``rows.start:rows.stop`` of ``block`` (a scalar's is ())."""
    if not block:
        return block
    first = block[0].start
    return (slice(first + rows.start, first + rows.stop), *block[1:])


def store_whole(blocks: LeafBlocks, captured: jax.Array, *, adopt: bool = False) -> None:
    """Copy a whole captured leaf into the host blocks, by overlap of global indices.

    The captured array may come back in another layout than planned: when a step returns
    an input buffer unchanged, XLA propagates shardings through the pass-through and the
    requested output sharding is not applied (a replicated Adam moment comes back sharded
    like its parameter). Copying by overlap works for any layout; every block must end up
    covered exactly once, or this process did not receive all it has to keep.
    """
    layout = blocks.layout
    shards = [(index_key(normalize_index(s.index, captured.shape)), s.data)
              for s in captured.addressable_shards if s.replica_id == 0]
    exact = dict(shards)
    for key in map(index_key, layout.blocks):
        if adopt and key in exact:
            blocks.adopt(key, np.asarray(exact[key]).reshape(extent(index_from_key(key))))
            continue
        dest = blocks[key]
        filled = 0
        for src_key, data in shards:
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(key, src_key)]
            if any(lo >= hi for lo, hi in overlap):
                continue
            dest[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, key))] = \
                np.asarray(data)[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, src_key))]
            filled += int(np.prod([hi - lo for lo, hi in overlap]))
        if filled != dest.size:
            raise WindowAborted(
                f"captured leaf of shape {layout.shape} covers {filled} of the {dest.size} elements "
                f"of host block {key}; its shards are not where this process expects them. {MOVED}")
