"""One host copy per element width: a window phase's outbox packed on each device, cut back
into per-leaf views on the host.

Why: XLA's schedulers overlap only some of many small asynchronous host copies with compute
and run the rest back to back at the start of the program, where nothing computes (the
compile-only H100 program of a 1B LM overlapped ~90 of 178-877 copies per phase; TPU v5e did
the same for a small LM). One large copy per group overlaps compute as a whole (where in the
step XLA starts it is its scheduler's choice: benchmarks/results/gpu_h200_1b_copy_schedule.md).

Packing never moves data between devices: inside ``jax.shard_map`` each device ravels the
rows it holds of every captured leaf (its local block, or the piece's rows of it) and
concatenates them into a 1-D array sharded over all mesh devices. Leaves are grouped by
element width, as the bits of an unsigned integer of that width (:func:`carrier`): the
float32 state and the int32 step count share one copy, where grouping by dtype gave the count
a copy of its own that the update waited for. The host cuts each device's part of the packed
copy back into the per-leaf arrays the engine consumes (:class:`Captured`: global shape,
and per distinct block its index and a zero-copy numpy view of the right dtype), so the
replay and the host buffers see what an unpacked outbox gives.

Two groups are packed separately, because they are ready at different times: the state
(slice, shared leaves, extras: inputs of the step, copied while it computes) and the
gradient pieces (ready after the backward pass, copied while the update runs).

A plan may pack only its small items (``CapturePlan.pack_max_bytes``, TPU): the serialized
copies are the small ones (XLA:TPU overlapped every copy over 1 MiB of the tiny to 1B LMs
and serialized many of those under it), while packing a large leaf costs device memory
(XLA:TPU relays out each (8,128)-tiled leaf into the 1-D array: 7.7 GiB of temporaries for
the 1B LM packed whole). The other items keep a copy of their own, in the outbox's lists,
in item order; :func:`overlap_ckpt.core.ticket.unpacked` merges the two back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..gil import yielding
from ..hostarray import HostShard, Index, index_key, normalize_index
from .slicing import Piece

if TYPE_CHECKING:  # types only: plan.py decides whether a plan packs, capture.py packs
    from .plan import CapturePlan, LeafLayout

# A serialized copy of at most this many bytes is tolerated by the compiled-program check
# (overlap_ckpt.aot.window): at a TPU host link (~25 GB/s) it blocks for ~40 us.
SMALL_COPY_BYTES = 1 << 20
@dataclasses.dataclass(frozen=True)
class Item:
    """One outbox array: rows ``piece.start:piece.stop`` of every local block of the leaf
    ``piece.leaf`` (an index into its own list: params, opt_state or extras)."""

    layout: LeafLayout
    piece: Piece

    @classmethod
    def whole(cls, layout: LeafLayout, leaf: int) -> "Item":
        return cls(layout, Piece(leaf, 0, layout.rows))

    @property
    def is_whole(self) -> bool:
        return self.piece.start == 0 and self.piece.stop == self.layout.rows

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of this item's part of one device's block."""
        shape = self.layout.block_shape
        return (self.piece.stop - self.piece.start,) + tuple(shape[1:]) if shape else ()

    @property
    def local_size(self) -> int:
        return int(np.prod(self.local_shape, dtype=np.int64))

    @property
    def local_bytes(self) -> int:
        """Bytes of this item on one device (what its own host copy moves per device)."""
        return self.local_size * np.dtype(self.layout.dtype).itemsize

    def rows_of(self, block: jax.Array) -> jax.Array:
        """This item's rows of one local block, ravelled."""
        if not self.layout.shape:
            return block.reshape(1)
        return block[self.piece.start:self.piece.stop].reshape(-1)


Source = str  # "params", "state" or "extras": the tree an item's leaf index points into


@dataclasses.dataclass(frozen=True)
class PhaseItems:
    """The state part of a phase's outbox, in outbox order (the host replay's order too)."""

    state: tuple[tuple[Source, Item], ...]  # slice pieces: each param piece, then its owned state
    shared: tuple[tuple[Source, Item], ...]
    extras: tuple[tuple[Source, Item], ...]

    def parts(self) -> tuple[tuple[str, tuple[tuple[Source, Item], ...]], ...]:
        """(outbox list name, its entries)."""
        return (("state", self.state), ("shared", self.shared), ("extras", self.extras))

    def state_items(self) -> list[Item]:
        """Every item, in the order :func:`pack` takes them for the state group."""
        return [item for _, entries in self.parts() for _, item in entries]


@functools.lru_cache(maxsize=64)
def phase_items(plan: CapturePlan, phase: int, with_extras: bool) -> PhaseItems:
    """What phase ``phase`` of ``plan`` captures from the step's input state."""
    state: list[tuple[Source, Item]] = []
    for piece in plan.slicing.slices[phase]:
        state.append(("params", Item(plan.params[piece.leaf], piece)))
        for j in plan.analysis.owned_state(piece.leaf):
            state.append(("state", Item(plan.state[j], plan.state_piece(j, piece))))
    shared = tuple(("state", Item.whole(plan.state[j], j)) for j in plan.analysis.shared_state)
    extras = tuple(("extras", Item.whole(layout, n)) for n, layout in enumerate(plan.extras)) if with_extras else ()
    return PhaseItems(tuple(state), shared, extras)


@functools.lru_cache(maxsize=64)
def grad_items(plan: CapturePlan, phase: int) -> tuple[Item, ...]:
    """The gradient pieces phase ``phase`` ships (those of slices ``0..phase``)."""
    return tuple(Item(plan.params[p.leaf], p) for p in plan.slicing.pieces_upto(phase))


@dataclasses.dataclass(frozen=True)
class Packing:
    """Which parts of an outbox are packed (outbox metadata: hashable, compared by value).
    The state group always is; ``extras``: it holds the extras too; ``grads``: the arrays
    after the state group hold the gradient pieces."""

    extras: bool
    grads: bool = False


def selected(plan: CapturePlan, items: Sequence[Item]) -> list[bool]:
    """Per item of a plan that packs: whether it travels packed (at most the plan's
    ``pack_max_bytes`` per device; every item when that is None) or in a copy of its own."""
    limit = plan.pack_max_bytes
    return [limit is None or item.local_bytes <= limit for item in items]


def merge(plan: CapturePlan, items: Sequence[Item], packed: Sequence[jax.Array], own: Sequence[Any]) -> list[Any]:
    """The outbox arrays of ``items``: the selected ones cut out of their packed host copies
    (:func:`unpack`), the others taken in order from ``own`` (their own copies)."""
    mask = selected(plan, items)
    cut = iter(unpack(packed, [item for item, packed_ in zip(items, mask) if packed_]))
    rest = iter(own)
    out = [next(cut) if packed_ else next(rest) for packed_ in mask]
    assert next(rest, None) is None, "more own copies than unpacked items"
    return out


def carrier(dtype: Any) -> np.dtype:
    """The unsigned integer type of ``dtype``'s width, in which its bits are packed: leaves
    of one width share a packed array (an Adam step count rides with the float32 state)."""
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


def groups(items: Sequence[Item]) -> list[tuple[np.dtype, list[int]]]:
    """Item positions grouped by :func:`carrier` type, in order of first appearance."""
    by_width: dict[np.dtype, list[int]] = {}
    for n, item in enumerate(items):
        by_width.setdefault(carrier(item.layout.dtype), []).append(n)
    return list(by_width.items())


def views(items: Sequence[Item]) -> list[bool]:
    """Per group (:func:`groups`): whether its packed array may be a view of a leaf (a group
    of one whole leaf packs to a reshape of it, which XLA need not copy)."""
    return [len(members) == 1 and items[members[0]].is_whole for _, members in groups(items)]


def pack(xs: Sequence[jax.Array], items: Sequence[Item], sharding: jax.sharding.Sharding) -> list[jax.Array]:
    """The arrays ``xs`` (global leaves; ``items`` say which rows) packed on each device, in
    device memory: one 1-D array per group (:func:`groups`), placed by ``sharding``
    (:func:`packed_sharding`)."""
    out = []
    for _, members in groups(items):
        parts = [xs[n] for n in members]
        group = [items[n] for n in members]
        if isinstance(sharding, NamedSharding):
            local = jax.shard_map(functools.partial(_concat, group), mesh=sharding.mesh,
                                  in_specs=tuple(item.layout.sharding.spec for item in group),
                                  out_specs=sharding.spec)
            out.append(local(*parts))
        else:
            out.append(_concat(group, *parts))
    return out


def packed_sharding(plan: CapturePlan) -> jax.sharding.Sharding:
    """Where a plan's packed arrays live: the one device of its leaves, or every device of
    their mesh, each holding its own part (:func:`overlap_ckpt.core.plan.packable` plans only these two cases)."""
    layouts = [*plan.params, *plan.state, *plan.extras]
    devices = {d for layout in layouts for d in layout.sharding.device_set}
    if len(devices) == 1:
        return jax.sharding.SingleDeviceSharding(next(iter(devices)))
    mesh = layouts[0].sharding.mesh
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names))


def _concat(items: Sequence[Item], *blocks: jax.Array) -> jax.Array:
    """One device's packed array: the items' rows, ravelled, as bits of their carrier type,
    end to end."""
    parts = [_bits(item.rows_of(block)) for item, block in zip(items, blocks)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _bits(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:  # no bitcast from bool: numpy's bool is one byte, 0 or 1
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, carrier(x.dtype))


class CapturedShard(HostShard):
    """One block of a :class:`Captured` array, read as the engine reads a ``jax.Shard``:
    :func:`unpack` keeps one block per index, so each is replica 0."""

    replica_id = 0


@dataclasses.dataclass(frozen=True)
class Captured:
    """An outbox array cut out of a packed host copy: what the engine reads of a captured
    ``jax.Array`` (shape, dtype, this process's distinct blocks), as views of the packed copy.

    Its global shape and block indices are those the unpacked capture returns: the whole
    leaf, or the piece's rows of every block stacked along axis 0 in block order (see
    :meth:`overlap_ckpt.core.plan.LeafLayout.block_of`).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    addressable_shards: list[CapturedShard]


def unpack(packed: Sequence[jax.Array], items: Sequence[Item]) -> list[Captured]:
    """The outbox arrays of ``items`` out of their packed host copies (see :func:`pack`)."""
    out: list[Captured | None] = [None] * len(items)
    for (_, members), array in yielding(zip(groups(items), packed, strict=True)):
        parts = [(s.device, np.asarray(s.data).reshape(-1)) for s in array.addressable_shards]  # lead axes: to_host
        offsets = np.cumsum([0] + [items[n].local_size for n in members])
        for n, start, stop in zip(members, offsets[:-1], offsets[1:]):
            dtype = np.dtype(items[n].layout.dtype)
            out[n] = _cut(items[n], [(device, data[start:stop].view(dtype)) for device, data in parts])
    return out


def _cut(item: Item, parts: list[tuple[Any, np.ndarray]]) -> Captured:
    """One item's blocks (one per distinct leaf index, first device holding it)."""
    layout = item.layout
    indices = layout.sharding.devices_indices_map(layout.shape)
    shards: dict[tuple, CapturedShard] = {}
    for device, data in parts:
        index = normalize_index(indices[device], layout.shape) if layout.shape else ()
        key = index_key(index)
        if key not in shards:
            shards[key] = CapturedShard(_captured_index(item, index), data.reshape(item.local_shape))
    return Captured(_captured_shape(item), np.dtype(layout.dtype), list(shards.values()))


def _captured_shape(item: Item) -> tuple[int, ...]:
    layout = item.layout
    if item.is_whole or not layout.shape:
        return layout.shape
    return ((layout.shape[0] // layout.rows) * (item.piece.stop - item.piece.start),) + tuple(layout.shape[1:])


def _captured_index(item: Item, index: Index) -> Index:
    """Where a block's rows sit in the captured array (:func:`_captured_shape`)."""
    if item.is_whole or not index:
        return index
    chunk = item.piece.stop - item.piece.start
    block = index[0].start // item.layout.rows
    return (slice(block * chunk, (block + 1) * chunk),) + tuple(index[1:])
