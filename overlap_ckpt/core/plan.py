"""The static description of how one train state is captured over a window.

A :class:`CapturePlan` is built once from the concrete state (outside ``jit``) because
shardings, shard shapes and addressability are only known on concrete arrays. Inside the
jitted step it is a compile-time constant: the step compiles once per window phase.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

from ..errors import TreeMismatchError, UnsupportedOptimizerError
from ..hostarray import index_key, is_prng_key, local_blocks, normalize_index, replica0_owners
from ..hostarray import part_rows as hostarray_part_rows
from . import backend
from .separability import UpdateAnalysis, UpdateFn, analyze_update, optax_update_fn
from .slicing import Piece, Slicing, make_slicing

log = logging.getLogger(__name__)

# TPU plans pack the items of at most this many bytes per device (make_plan). Measured on
# v5e:2x2 (NNX LM, K=2): at 64 KiB every copy of the tiny LM overlaps, and the 20m LM's
# phases stay within plain + outbox with the copies XLA still serializes all at most
# packing.SMALL_COPY_BYTES; at 1 MiB the 20m LM's packed group cost 23 MiB of device memory beyond
# its outbox (the relayout of the tiled leaves into the 1-D array).
TPU_PACK_MAX_BYTES = 64 << 10


def packable(layouts: Sequence[LeafLayout]) -> bool:
    """True when every leaf lives on one device, or all on one mesh (``NamedSharding``):
    then each device can pack its own blocks. Other shardings are copied leaf by leaf."""
    devices = {d for layout in layouts for d in layout.sharding.device_set}
    if len(devices) == 1:
        return True
    meshes = {layout.sharding.mesh if isinstance(layout.sharding, NamedSharding) else None for layout in layouts}
    return len(meshes) == 1 and None not in meshes


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one leaf lives: its global aval, sharding and this process's blocks."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding
    block_shape: tuple[int, ...]
    # Global indices of the distinct blocks this process keeps (replica 0 only).
    blocks: tuple[tuple[slice, ...], ...]

    def __hash__(self) -> int:  # slices are unhashable before Python 3.12
        return hash((self.shape, self.dtype, self.sharding, self.block_shape,
                     tuple(index_key(b) for b in self.blocks)))

    @property
    def rows(self) -> int:
        """Rows of a local block along axis 0 (scalars count as one row)."""
        return self.block_shape[0] if self.block_shape else 1

    @property
    def block_row_bytes(self) -> int:
        """Bytes of one row of one device's block: what each device copies per row, the
        same on every process (a process may keep several blocks of a leaf or none)."""
        per_row = int(np.prod(self.block_shape[1:])) if self.block_shape else 1
        return per_row * np.dtype(self.dtype).itemsize

    @property
    def row_bytes(self) -> int:
        return self.block_row_bytes * max(len(self.blocks), 1)

    def block_of(self, out_index: tuple[slice, ...], piece: Piece) -> tuple[slice, ...]:
        """The block a captured shard of ``piece`` belongs to (see :mod:`capture`)."""
        if not self.shape:
            return ()
        chunk = piece.stop - piece.start
        p = out_index[0].start // chunk
        rows = self.rows
        return (slice(p * rows, (p + 1) * rows),) + tuple(out_index[1:])


def leaf_layout(x: Any) -> LeafLayout:
    """The layout of a concrete array or of a ``jax.ShapeDtypeStruct`` with a sharding.

    An abstract leaf is planned without data: a replica of a ``pmap`` state, or a state
    placed on compile-only devices (``overlap_ckpt.aot`` compiles window programs for a
    TPU mesh or an H100 from a CPU machine), sharded over a mesh (FSDP) or not.
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:
            raise TypeError("an abstract leaf (jax.ShapeDtypeStruct) needs a sharding to be planned: "
                            "pass sharding=NamedSharding(mesh, spec) or SingleDeviceSharding(device)")
        blocks = abstract_blocks(tuple(x.shape), x.sharding)
    else:
        if not isinstance(x, jax.Array):
            x = jax.numpy.asarray(x)
        blocks = [index for index, _ in local_blocks(x)]
    sharding = x.sharding
    return LeafLayout(tuple(x.shape), np.dtype(x.dtype), sharding, tuple(sharding.shard_shape(x.shape)),
                      tuple(sorted(blocks, key=index_key)))


def leaf_sharding(x: Any) -> jax.sharding.Sharding | None:
    """The sharding of a concrete or abstract leaf (None for a numpy or Python value)."""
    return x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None


def abstract_blocks(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> list[tuple[slice, ...]]:
    """The distinct blocks of an array of ``shape`` placed by ``sharding`` that this process
    would hold (one per shard, as :func:`overlap_ckpt.hostarray.local_blocks` yields them)."""
    blocks: dict = {}
    for device, index in sharding.devices_indices_map(shape).items():
        if device.process_index == jax.process_index():
            index = normalize_index(index, shape)
            blocks.setdefault(index_key(index), index)
    return list(blocks.values())


def replica0_blocks(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> list[tuple[slice, ...]]:
    """The distinct blocks of an array of ``shape`` placed by ``sharding`` whose replica 0
    this process holds: the blocks :func:`overlap_ckpt.hostarray.local_blocks` yields for a
    concrete array so placed."""
    return [index for index, process in replica0_owners(shape, sharding) if process == jax.process_index()]


def placed_as(layout: LeafLayout, sharding: jax.sharding.Sharding) -> LeafLayout:
    """``layout``'s leaf as it is captured when placed by ``sharding`` instead."""
    return dataclasses.replace(layout, sharding=sharding, block_shape=tuple(sharding.shard_shape(layout.shape)),
                               blocks=tuple(replica0_blocks(layout.shape, sharding)))


def refines(fine: jax.sharding.Sharding, coarse: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """Whether every device's block under ``fine`` lies in its block under ``coarse``: a
    leaf placed by ``coarse`` is then resliced to ``fine`` on its own devices, no traffic."""
    coarse_map = coarse.devices_indices_map(shape)
    for device, index in fine.devices_indices_map(shape).items():
        outer = coarse_map.get(device)
        if outer is None:
            return False
        inner, outer = normalize_index(index, shape), normalize_index(outer, shape)
        if any(i.start < o.start or i.stop > o.stop for i, o in zip(inner, outer)):
            return False
    return True


def unit_layouts(params_l: list[LeafLayout], state_l: list[LeafLayout],
                 analysis: UpdateAnalysis) -> tuple[list[LeafLayout], list[LeafLayout], list[int]]:
    """One capture layout per unit: a parameter and the optimizer-state leaves of its shape
    that it owns are captured placed alike.

    Why: each process replays its own blocks, elementwise, with no communication, so it
    must receive the same blocks of a parameter, of its gradient and of its moments. Jobs
    do not always place them alike: under ``jax.jit`` XLA chooses the moments' layout (it
    replicated the Adam moments of FSDP-sharded parameters), and ZeRO-1 shards the moments
    of replicated parameters on purpose. The unit is captured in the layout of its member
    with the smallest blocks (the parameter's on a tie): the others are resliced to it in
    the window step, which is local when that layout refines theirs (a replicated or less
    sharded leaf). The live state keeps its own placement; only the window's host copies
    follow the unit's layout, and storage keeps global indices, so the checkpoint does not
    depend on it.

    Also returns the parameter leaves whose unit the chosen layout does not refine (an Adam
    moment sharded on columns, its parameter on rows): XLA:CPU rounds the device's update of
    such a unit otherwise than the host's replay of it on one layout (the parameter came
    out up to 63 ulp off the live one), so :func:`make_plan` gives them a one-step window.
    """
    params_l, state_l = list(params_l), list(state_l)
    mixed = []
    for k, param in enumerate(params_l):
        members = [j for j in analysis.owned_state(k) if state_l[j].shape == param.shape]
        candidates = [param, *(state_l[j] for j in members)]
        if len({c.sharding for c in candidates}) == 1:
            continue
        if not all(isinstance(c.sharding, jax.sharding.NamedSharding) for c in candidates) or \
                len({c.sharding.mesh for c in candidates}) != 1:
            continue  # not on one mesh: whole-leaf slices (see make_plan), as before
        chosen = min(candidates, key=lambda c: int(np.prod(c.block_shape))).sharding
        if not all(refines(chosen, c.sharding, param.shape) for c in candidates):
            mixed.append(k)
        params_l[k] = placed_as(param, chosen)
        for j in members:
            state_l[j] = placed_as(state_l[j], chosen)
    return params_l, state_l, mixed


def _layouts(tree) -> tuple[Any, list[LeafLayout]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [leaf_layout(x) for x in leaves]


@dataclasses.dataclass(eq=False)
class CapturePlan:
    """Everything the device capture and the host replay agree on for a window.

    A plan is a compile-time constant of the window variants of the train step, so it
    compares *by value*: a second manager (or a re-plan) for the same optimizer object on
    a state of the same structure, shapes and shardings reuses the compiled step instead
    of compiling it again.
    """

    tx: optax.GradientTransformation
    update: UpdateFn  # derived from tx: not part of the value
    params_def: Any
    state_def: Any
    extras_def: Any
    params: list[LeafLayout]
    state: list[LeafLayout]
    extras: list[LeafLayout]
    analysis: UpdateAnalysis
    slicing: Slicing
    chunked: bool  # leaves may be split into row chunks (elementwise update)
    platform: str  # "cpu", "gpu", "tpu": how the update is isolated on the device
    outbox_memory: str | None = "pinned_host"  # memory kind of the captured copies (None: device)
    pack_outbox: bool = False  # one host copy per element width instead of one per leaf (core.packing)
    pack_max_bytes: int | None = None  # pack only items of at most this many bytes per device (None: all)
    # The shardings the leaves had when planned (params, opt_state, extras), before small
    # leaves were moved onto the state's mesh: what :meth:`matches` compares the live state
    # with. Not part of the plan's value (the layouts above are what the capture uses).
    placements: tuple = ()
    # (flat index over params then opt_state, the live placement) of each leaf the state keeps
    # in another layout than its unit's capture layout (:func:`placed_apart`): the window steps
    # compute its update apart from that placement (overlap_ckpt.core.capture.updated_apart),
    # so it is part of the plan's value.
    apart: tuple[tuple[int, NamedSharding], ...] = ()

    def _key(self) -> tuple:
        return (self.tx.init, self.tx.update, self.params_def, self.state_def, self.extras_def,
                tuple(self.params), tuple(self.state), tuple(self.extras), self.analysis,
                self.slicing, self.chunked, self.platform, self.outbox_memory, self.pack_outbox,
                self.pack_max_bytes, self.apart)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return isinstance(other, CapturePlan) and hash(self) == hash(other) and self._key() == other._key()

    def __repr__(self) -> str:
        # Short on purpose: the plan is in the tree structure of every window step, so jax
        # prints it in structure-mismatch errors (a full dataclass repr runs to tens of KB).
        return (f"CapturePlan({len(self.params)} params leaves, {len(self.state)} opt_state leaves, "
                f"K={self.k}, {'row chunks' if self.chunked else 'whole leaves'}, {self.platform}, "
                f"id={hash(self) & 0xffff:04x})")

    def __hash__(self) -> int:
        # Hashed once: jit hashes the plan at every dispatch of a window step.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash(self._key())
        return cached

    @property
    def k(self) -> int:
        return self.slicing.k

    @property
    def state_bytes(self) -> int:
        return sum(l.rows * l.row_bytes for l in (*self.params, *self.state))

    @property
    def grad_bytes(self) -> int:
        return sum(l.rows * l.row_bytes for l in self.params)

    def state_piece(self, j: int, piece: Piece) -> Piece:
        """The piece of state leaf ``j`` captured with a piece of its parameter: the same
        rows when leaves are chunked, the whole leaf when the piece is the whole leaf."""
        if piece.start == 0 and piece.stop == self.params[piece.leaf].rows:
            return Piece(j, 0, self.state[j].rows)
        return Piece(j, piece.start, piece.stop)

    def matches(self, params, opt_state, extras) -> "Mismatch | None":
        """Why this plan does not fit the given state, or None when it does.

        A leaf placed otherwise than when planned does not fit: this process would keep
        other blocks of it. ``jax.jit`` without ``out_shardings`` lets XLA pick the
        shardings of the step's outputs, and it often shards a replicated leaf (a bias, an
        optimizer moment) after the first step; a plan made from the state before it would
        expect blocks that no process receives.
        """
        placements = iter(self.placements)
        for name, tree, treedef, layouts in (("params", params, self.params_def, self.params),
                                             ("opt_state", opt_state, self.state_def, self.state),
                                             ("extras", extras, self.extras_def, self.extras)):
            leaves, got_def = jax.tree.flatten(tree)
            if got_def != treedef:
                return Mismatch(f"the structure of {name} changed")
            for (path, x), layout in zip(jax.tree_util.tree_flatten_with_path(tree)[0], layouts):
                if tuple(np.shape(x)) != layout.shape or np.dtype(x.dtype) != layout.dtype:
                    return Mismatch(f"{name}{jax.tree_util.keystr(path)} is {np.shape(x)}/{x.dtype}, "
                                    f"planned {layout.shape}/{layout.dtype}")
                planned = next(placements, None)
                if isinstance(x, jax.Array) and planned is not None and x.sharding != planned \
                        and not x.sharding.is_equivalent_to(planned, x.ndim):  # == first: 10x cheaper
                    return Mismatch(f"{name}{jax.tree_util.keystr(path)} is placed as "
                                    f"{_placement(x.sharding)}, planned {_placement(planned)}", moved=True)
        return None


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Why a plan does not fit a state; ``moved`` when only a leaf's placement changed."""

    why: str
    moved: bool = False


def _placement(sharding: jax.sharding.Sharding) -> str:
    spec = getattr(sharding, "spec", None)
    return f"PartitionSpec{tuple(spec)}" if spec is not None else type(sharding).__name__


def make_plan(tx: optax.GradientTransformation, params, opt_state, extras, window: int,
              *, chunk_leaves: bool | None = None, outbox_memory: str | None = "pinned_host",
              platform: str | None = None, pack_outbox: bool | None = None,
              pack_max_bytes: int | None = None) -> CapturePlan:
    """Analyse the optimizer on this state and split the state into ``window`` slices.

    ``chunk_leaves``: None splits leaves into row chunks when the update allows it;
    False forces whole-leaf slices. ``outbox_memory``: the memory kind window steps copy
    into (None leaves the copies in device memory, for ``jax.pmap``). ``platform``: the
    backend whose isolation rule the capture follows (default: the params' devices').
    ``pack_outbox``: pack each phase's outbox into one host copy per element width
    (:mod:`overlap_ckpt.core.packing`); None packs on GPU and TPU. XLA:GPU overlaps a few
    large copies with compute but not hundreds of small ones (compile-only H100, 1B LM).
    ``pack_max_bytes``: pack only the items of at most this many bytes per device, the
    others keep a copy each; None: every item, except on TPU, where only items up to
    :data:`TPU_PACK_MAX_BYTES` are packed. XLA:TPU serialized most
    small per-leaf copies of the tiny LMs but overlapped every larger one (all 877 of the
    1B LM on v5e:2x2), and packing every leaf there cost 7.7 GiB of device temporaries
    (each tiled leaf relaid out into the 1-D packed array). On the CPU the copy is a
    memcpy that packing would double: it does not pack unless told to.
    """
    _refuse_prng_keys(opt_state, extras)
    update = optax_update_fn(tx)
    placements = tuple(leaf_sharding(x) for x in jax.tree.leaves((params, opt_state, extras)))
    params_def, params_l = _layouts(params)
    state_def, state_l = _layouts(opt_state)
    extras_def, extras_l = _layouts(extras)
    mesh_sharding = next((l.sharding for l in params_l if isinstance(l.sharding, jax.sharding.NamedSharding)), None)
    if mesh_sharding is not None:
        params_l, state_l, extras_l = ([_on_state_devices(l, mesh_sharding) for l in group]
                                       for group in (params_l, state_l, extras_l))
    if not params_l:
        raise TreeMismatchError("params has no array leaves; there is nothing to checkpoint.")
    analysis = analyze_update(update, params, opt_state)
    params_l, state_l, mixed = unit_layouts(params_l, state_l, analysis)
    if mixed and window > 1:
        names = _leaf_names("params", params)
        log.warning("window of %d steps reduced to 1 (an in-graph snapshot, exact): %s and its optimizer state "
                    "are sharded across each other (e.g. rows against columns), and the host cannot replay such "
                    "an update bit for bit. Lay out each parameter's optimizer state like the parameter, "
                    "replicated, or more finely on the same axes to keep multi-step windows.",
                    window, ", ".join(names[k] for k in mixed))
        window = 1
    chunk = analysis.chunkable if chunk_leaves is None else (chunk_leaves and analysis.chunkable)
    if chunk_leaves and not analysis.chunkable:
        log.info("whole-leaf slices: %s", analysis.why_not_chunkable)
    for j, owner in enumerate(analysis.state_owner):
        if owner is not None and chunk and state_l[j].block_shape != params_l[owner].block_shape:
            log.info("opt_state leaf %d is sharded differently from its parameter; whole-leaf slices", j)
            chunk = False
    if window > 1 and not chunk:
        _refuse_split_leaves(params, opt_state, params_l, state_l, analysis,
                             analysis.why_not_chunkable if not analysis.chunkable else
                             "its state is laid out otherwise than its parameters")
    unit_rows, unit_row_bytes = [], []
    for k, layout in enumerate(params_l):
        owned = analysis.owned_state(k)
        units = -(-layout.rows // part_rows(layout)) if chunk else 1
        # Per device, not per process: every process must cut the same slices (the window
        # steps are one program on all of them), and a process may keep several blocks of
        # a leaf or none (a replicated leaf's replica 0 is on one process).
        total = layout.rows * layout.block_row_bytes + sum(state_l[j].rows * state_l[j].block_row_bytes
                                                           for j in owned)
        unit_rows.append(units)
        unit_row_bytes.append(max(total // units, 1))
    # A unit's gradient has its parameter's shape and dtype: what a window step ships of it.
    unit_bytes = sum(r * b for r, b in zip(unit_rows, unit_row_bytes))
    grad_per_state = sum(l.rows * l.block_row_bytes for l in params_l) / max(unit_bytes, 1)
    slicing = make_slicing(unit_rows, unit_row_bytes, window, chunk, grad_per_state)
    # Units back to rows; whole-leaf pieces cover all rows of the leaf.
    slicing = Slicing(tuple(tuple(_rows_of_units(params_l[p.leaf], p, chunk) for p in s) for s in slicing.slices))
    platform = platform or backend.platform_of(next(iter(params_l[0].sharding.device_set)))
    if pack_outbox is None:
        pack_outbox = platform in ("gpu", "tpu")
    pack_outbox = pack_outbox and outbox_memory is not None and packable([*params_l, *state_l, *extras_l])
    if pack_max_bytes is None and platform == "tpu":
        pack_max_bytes = TPU_PACK_MAX_BYTES
    return CapturePlan(tx, update, params_def, state_def, extras_def, params_l, state_l, extras_l,
                       analysis, slicing, chunk, platform, outbox_memory, pack_outbox,
                       pack_max_bytes if pack_outbox else None, placements,
                       placed_apart(placements, [*params_l, *state_l]))


def placed_apart(placements: Sequence[Any],
                 layouts: Sequence[LeafLayout]) -> tuple[tuple[int, NamedSharding], ...]:
    """``(index, placement)`` of each array leaf whose live placement (on the same devices)
    is not the layout it is captured in: a unit member resliced to its unit's layout
    (:func:`unit_layouts`), a replicated Adam moment beside a sharded parameter."""
    return tuple((i, placed) for i, (placed, layout) in enumerate(zip(placements, layouts))
                 if layout.shape and isinstance(placed, NamedSharding) and isinstance(layout.sharding, NamedSharding)
                 and placed.device_set == layout.sharding.device_set
                 and not placed.is_equivalent_to(layout.sharding, len(layout.shape)))


def _leaf_names(prefix: str, tree: Any) -> list[str]:
    """Each leaf of ``tree`` as a user writes it (``params['l0']['w']``), in tree order."""
    return [f"{prefix}{jax.tree_util.keystr(p)}" for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def split_across_processes(layout: LeafLayout) -> bool:
    """Whether the replica-0 blocks of a leaf lie on more than one process (decided from
    the sharding alone, so every process decides alike)."""
    return len({process for _, process in replica0_owners(layout.shape, layout.sharding)}) > 1


def _refuse_split_leaves(params, opt_state, params_l: list[LeafLayout], state_l: list[LeafLayout],
                         analysis: UpdateAnalysis, why: str) -> None:
    """Whole-leaf windows replay each unit on one process, which must then hold all of it:
    a unit split across processes is refused at ``prepare``, naming the leaf and layout."""
    names, state_names = _leaf_names("params", params), _leaf_names("opt_state", opt_state)
    for k, layout in enumerate(params_l):
        members = [(names[k], layout)] + [(state_names[j], state_l[j]) for j in analysis.owned_state(k)]
        for name, member in members:
            if member.shape and split_across_processes(member):
                raise UnsupportedOptimizerError(
                    f"windows of more than one step replay this optimizer on whole leaves ({why}), so "
                    f"one process must hold all of {name}, but it is placed as {_placement(member.sharding)} "
                    "over several processes. Use window=1 (a one-step in-graph snapshot) with this "
                    "optimizer and layout, or keep the leaf whole on each process (replicated, or "
                    "sharded over the devices of one process only).")


def _refuse_prng_keys(opt_state: Any, extras: Any) -> None:
    """Typed PRNG keys (``jax.random.key``) are refused by name, before anything reads
    their dtype, which numpy cannot hold.

    Why refused in the optimizer state: the window step would have to ship the key's
    data and the host replay wrap it again, and the per-leaf keys an optimizer splits off
    it (``optax.noisy_sgd``'s noise) are not global scalars the replay can inject; none of
    that exists yet. In ``extras`` a key is only saved, and the doors already save its key
    data (``jax.random.key_data``); a caller of the engine passes the data itself.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        if is_prng_key(leaf):
            raise UnsupportedOptimizerError(
                f"the optimizer state holds a typed PRNG key at opt_state{jax.tree_util.keystr(path)} "
                "(optax.noisy_sgd and optax.add_noise keep one): overlap_ckpt cannot capture or "
                "replay random optimizer state yet. Use an optimizer without a key in its state "
                "(docs/optimizers.md), or checkpoint this training with orbax.checkpoint directly.")
    for path, leaf in jax.tree_util.tree_flatten_with_path(extras)[0]:
        if is_prng_key(leaf):
            raise TypeError(
                f"extras{jax.tree_util.keystr(path)} is a typed PRNG key, whose dtype a checkpoint "
                "cannot hold: pass jax.random.key_data(key) and wrap it again with "
                "jax.random.wrap_key_data after restore (the Linen and NNX doors do this for you).")


def part_rows(layout: LeafLayout) -> int:
    """The rows a row-chunked leaf is cut at multiples of (by slices and replay calls):
    :func:`overlap_ckpt.hostarray.part_rows` of its device blocks, the same on every process."""
    return hostarray_part_rows(layout.block_shape, layout.dtype.itemsize)


def _rows_of_units(layout: LeafLayout, piece: Piece, chunk: bool) -> Piece:
    if not chunk:
        return Piece(piece.leaf, 0, layout.rows)
    n = part_rows(layout)
    return Piece(piece.leaf, piece.start * n, min(piece.stop * n, layout.rows))


def _on_state_devices(layout: LeafLayout, state_sharding: jax.sharding.Sharding) -> LeafLayout:
    """Small leaves (a step counter, an optimizer count, an RNG key) often live on one
    device while the state is sharded over a mesh; inside the step they are captured
    replicated on that mesh, since a jitted program cannot place outputs off its devices."""
    if layout.sharding.device_set == state_sharding.device_set:
        return layout
    replicated = jax.sharding.NamedSharding(state_sharding.mesh, jax.sharding.PartitionSpec())
    index = tuple(slice(0, n) for n in layout.shape)
    return dataclasses.replace(layout, sharding=replicated, block_shape=layout.shape, blocks=(index,))
