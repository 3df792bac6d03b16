"""The static description of how one train state is captured over a window.

A :class:`CapturePlan` is built once from the concrete state (outside ``jit``) because
shardings, shard shapes and addressability are only known on concrete arrays. Inside the
jitted step it is a compile-time constant: the step compiles once per window phase.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np
import optax

from .errors import ConfigError, TreeMismatchError, UnsupportedOptimizerError
from .hostarray import normalize_index
from .separability import UpdateAnalysis, UpdateFn, analyze_update, optax_update_fn
from .slicing import Piece, Slicing, make_slicing

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one leaf lives: its global aval, sharding and this process's blocks."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding
    block_shape: tuple[int, ...]
    # Global indices of the distinct blocks this process keeps (replica 0 only).
    blocks: tuple[tuple[slice, ...], ...]

    @property
    def rows(self) -> int:
        """Rows of a local block along axis 0 (scalars count as one row)."""
        return self.block_shape[0] if self.block_shape else 1

    @property
    def row_bytes(self) -> int:
        per_row = int(np.prod(self.block_shape[1:])) if self.block_shape else 1
        return per_row * np.dtype(self.dtype).itemsize * max(len(self.blocks), 1)

    def block_of(self, out_index: tuple[slice, ...], piece: Piece) -> tuple[slice, ...]:
        """The block a captured shard of ``piece`` belongs to (see :mod:`capture`)."""
        if not self.shape:
            return ()
        chunk = piece.stop - piece.start
        p = out_index[0].start // chunk
        rows = self.rows
        return (slice(p * rows, (p + 1) * rows),) + tuple(out_index[1:])


def leaf_layout(x: jax.Array) -> LeafLayout:
    if not isinstance(x, jax.Array):
        x = jax.numpy.asarray(x)
    sharding = x.sharding
    keys = sorted({tuple((s.start, s.stop) for s in normalize_index(shard.index, x.shape))
                   for shard in x.addressable_shards if shard.replica_id == 0})
    blocks = [tuple(slice(a, b) for a, b in key) for key in keys]
    return LeafLayout(tuple(x.shape), np.dtype(x.dtype), sharding,
                      tuple(sharding.shard_shape(x.shape)), tuple(blocks))


def _layouts(tree) -> tuple[Any, list[LeafLayout]]:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [leaf_layout(x) for x in leaves]


@dataclasses.dataclass(eq=False)  # hashed by identity: a static argument of the jitted step
class CapturePlan:
    """Everything the device capture and the host replay agree on for a window."""

    tx: optax.GradientTransformation
    update: UpdateFn
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

    def matches(self, params, opt_state, extras) -> str | None:
        """Why this plan does not fit the given state, or None when it does."""
        for name, tree, treedef, layouts in (("params", params, self.params_def, self.params),
                                             ("opt_state", opt_state, self.state_def, self.state),
                                             ("extras", extras, self.extras_def, self.extras)):
            leaves, got_def = jax.tree.flatten(tree)
            if got_def != treedef:
                return f"the structure of {name} changed"
            for (path, x), layout in zip(jax.tree_util.tree_flatten_with_path(tree)[0], layouts):
                if tuple(np.shape(x)) != layout.shape or np.dtype(x.dtype) != layout.dtype:
                    return (f"{name}{jax.tree_util.keystr(path)} is {np.shape(x)}/{x.dtype}, "
                            f"planned {layout.shape}/{layout.dtype}")
        return None


def make_plan(tx: optax.GradientTransformation, params, opt_state, extras, window: int,
              *, chunk_leaves: bool | None = None) -> CapturePlan:
    """Analyse the optimizer on this state and split the state into ``window`` slices.

    ``chunk_leaves``: None splits leaves into row chunks when the update allows it;
    False forces whole-leaf slices.
    """
    if window < 1:
        raise ConfigError(f"window must be >= 1, got {window}")
    update = optax_update_fn(tx)
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
    chunk = analysis.chunkable if chunk_leaves is None else (chunk_leaves and analysis.chunkable)
    if chunk_leaves and not analysis.chunkable:
        log.info("whole-leaf slices: %s", analysis.why_not_chunkable)
    for j, owner in enumerate(analysis.state_owner):
        if owner is not None and chunk and state_l[j].block_shape != params_l[owner].block_shape:
            log.info("opt_state leaf %d is sharded differently from its parameter; whole-leaf slices", j)
            chunk = False
    if window > 1 and not chunk:
        for k, layout in enumerate(params_l):
            if len(layout.blocks) > 1 and not _fully_addressable(layout):
                raise UnsupportedOptimizerError(
                    "this optimizer reduces within a leaf, so the host needs whole leaves, but "
                    f"parameter leaf {k} is split across processes. Use window=1 (a one-step "
                    "in-graph snapshot) for this optimizer in multi-process jobs.")
    unit_rows, unit_row_bytes = [], []
    for k, layout in enumerate(params_l):
        owned = analysis.owned_state(k)
        rows = layout.rows if chunk else 1
        total = layout.rows * layout.row_bytes + sum(state_l[j].rows * state_l[j].row_bytes for j in owned)
        unit_rows.append(rows)
        unit_row_bytes.append(max(total // rows, 1))
    slicing = make_slicing(unit_rows, unit_row_bytes, window, chunk)
    if not chunk:  # whole-leaf pieces cover all rows of the leaf
        slicing = Slicing(tuple(tuple(Piece(p.leaf, 0, params_l[p.leaf].rows) for p in s)
                                for s in slicing.slices))
    return CapturePlan(tx, update, params_def, state_def, extras_def, params_l, state_l, extras_l,
                       analysis, slicing, chunk, next(iter(params_l[0].sharding.device_set)).platform)


def _on_state_devices(layout: LeafLayout, state_sharding: jax.sharding.Sharding) -> LeafLayout:
    """Small leaves (a step counter, an optimizer count, an RNG key) often live on one
    device while the state is sharded over a mesh; inside the step they are captured
    replicated on that mesh, since a jitted program cannot place outputs off its devices."""
    if layout.sharding.device_set == state_sharding.device_set:
        return layout
    replicated = jax.sharding.NamedSharding(state_sharding.mesh, jax.sharding.PartitionSpec())
    index = tuple(slice(0, n) for n in layout.shape)
    return dataclasses.replace(layout, sharding=replicated, block_shape=layout.shape, blocks=(index,))


def _fully_addressable(layout: LeafLayout) -> bool:
    covered = sum(int(np.prod([s.stop - s.start for s in b])) for b in layout.blocks)
    return covered == int(np.prod(layout.shape))
