"""Host side: assemble one window's slices and replay the optimizer until all reach V.

Versions (DESIGN.md section 1): slice ``i`` is captured from the state that step
``V-K+1+i`` reads. After phase ``j`` arrives, slices ``0..j`` all hold version
``V-K+1+j``, so one replay call applies that step's gradient to all of them at once
(streaming: the host keeps one state copy plus one step of gradients). The last phase
brings slice ``K-1`` already at version V, with the shared leaves and extras of V.

The replay runs the user's own optax update, traced on a tree of the *same structure*
as the device's: leaves not in the slices being advanced are one-row dummies. Keeping the
structure keeps masks, per-leaf branches and XLA's use counts of shared scalars the same
as on the device, which is what makes the result bitwise equal on the CPU backend.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np

from .errors import WindowAborted
from .capture import unpack_globals
from .hostarray import HostArray, HostShard, normalize_index
from .jaxpr_interp import interpret
from .plan import CapturePlan, LeafLayout
from .separability import flat_update_fn, input_tokens
from .slicing import Piece

log = logging.getLogger(__name__)

BlockKey = tuple[tuple[int, int], ...]


def block_key(index: Sequence[slice]) -> BlockKey:
    return tuple((s.start, s.stop) for s in index)


class HostBuffers:
    """One host copy of a train state: every block this process keeps, allocated once.

    Blocks are touched at allocation so the copies during a window do not page-fault
    (a memcpy into fresh memory is several times slower).
    """

    def __init__(self, plan: CapturePlan):
        self.plan = plan
        self.params = [self._alloc(l) for l in plan.params]
        self.state = [self._alloc(l) for l in plan.state]
        self.extras = [self._alloc(l) for l in plan.extras]

    @staticmethod
    def _alloc(layout: LeafLayout) -> dict[BlockKey, np.ndarray]:
        blocks = {}
        for index in layout.blocks:
            shape = tuple(s.stop - s.start for s in index)
            blocks[block_key(index)] = np.zeros(shape, layout.dtype)
        return blocks

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for group in (self.params, self.state, self.extras)
                   for leaf in group for b in leaf.values())


def host_array(layout: LeafLayout, blocks: dict[BlockKey, np.ndarray]) -> HostArray:
    shards = [HostShard(tuple(slice(a, b) for a, b in key), data) for key, data in blocks.items()]
    return HostArray(layout.shape, layout.dtype, shards)


def replicated_value(x: jax.Array) -> np.ndarray:
    """The value of a replicated (scalar-like) array from this process's first copy."""
    return np.asarray(x.addressable_shards[0].data)


def _store(layout: LeafLayout, blocks: dict[BlockKey, np.ndarray], captured: jax.Array, piece: Piece) -> None:
    """Copy a captured piece (pinned-host array) into the host blocks it belongs to."""
    if piece.start == 0 and piece.stop == layout.rows and tuple(captured.shape) == layout.shape:
        _store_whole(layout, blocks, captured)
        return
    for shard in captured.addressable_shards:
        if shard.replica_id != 0:
            continue
        out_index = normalize_index(shard.index, captured.shape)
        key = block_key(layout.block_of(out_index, piece))
        dest = blocks[key]
        if layout.shape:
            dest = dest[piece.start:piece.stop]
        np.copyto(dest, np.asarray(shard.data), casting="no")


def _store_whole(layout: LeafLayout, blocks: dict[BlockKey, np.ndarray], captured: jax.Array) -> None:
    """Copy a whole captured leaf into the host blocks, by overlap of global indices.

    The captured array may come back in another layout than planned: when a step returns
    an input buffer unchanged, XLA propagates shardings through the pass-through and the
    requested output sharding is not applied (a replicated Adam moment comes back sharded
    like its parameter). Copying by overlap works for any layout; every block must end up
    covered exactly once, or this process did not receive all it has to keep.
    """
    shards = [(block_key(normalize_index(s.index, captured.shape)), s.data)
              for s in captured.addressable_shards if s.replica_id == 0]
    for key, dest in blocks.items():
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
                f"of host block {key}; its shards are not where this process expects them.")


class WindowReplay:
    """Receives the phases of one window in order and produces the host state at V."""

    def __init__(self, plan: CapturePlan, buffers: HostBuffers, version: int, programs: "ReplayPrograms"):
        self.plan = plan
        self.buffers = buffers
        self.version = version
        self.programs = programs
        self.next_phase = 0
        self.shared_after_replay: list[np.ndarray] | None = None
        self.shared: list[np.ndarray] = []
        self.replayed_bytes = 0  # bytes of params + owned state advanced by replay

    @property
    def complete(self) -> bool:
        return self.next_phase == self.plan.k

    def receive(self, phase: int, outbox: dict[str, list[jax.Array]]) -> None:
        plan = self.plan
        if phase != self.next_phase:
            raise WindowAborted(f"window for step {self.version} expected phase {self.next_phase}, got {phase}")
        captured = iter(outbox["state"])
        for piece in plan.slicing.slices[phase]:
            _store(plan.params[piece.leaf], self.buffers.params[piece.leaf], next(captured), piece)
            for j in plan.analysis.owned_state(piece.leaf):
                _store(plan.state[j], self.buffers.state[j], next(captured), self.plan.state_piece(j, piece))
        self.shared = [replicated_value(x) for x in outbox["shared"]]
        self._check_shared_version(phase)
        if phase < plan.k - 1:
            packed = [replicated_value(g) for g in outbox["globals"]]
            self._replay(phase, outbox["grads"], unpack_globals(packed, plan.analysis.cut_signature))
        else:
            for layout, blocks, x in zip(plan.extras, self.buffers.extras, outbox["extras"]):
                _store(layout, blocks, x, Piece(0, 0, layout.rows))
            for j, x in zip(plan.analysis.shared_state, outbox["shared"]):
                _store(plan.state[j], self.buffers.state[j], x, Piece(j, 0, plan.state[j].rows))
        self.next_phase += 1

    def _check_shared_version(self, phase: int) -> None:
        """Integer shared leaves (step counts) replayed to this phase must equal the ones the
        device just reported: a missed or repeated step would otherwise go unnoticed."""
        if self.shared_after_replay is None:
            return
        for replayed, fresh in zip(self.shared_after_replay, self.shared):
            if np.issubdtype(fresh.dtype, np.integer) and not np.array_equal(replayed, fresh):
                raise WindowAborted(
                    f"window for step {self.version}: optimizer counters after replaying phase "
                    f"{phase - 1} are {replayed.tolist()} but the device reports {fresh.tolist()}; "
                    "a training step was not reported to the checkpointer. The window is discarded.")

    def _replay(self, phase: int, grads: list[jax.Array], injected: list[np.ndarray]) -> None:
        plan = self.plan
        pieces = plan.slicing.pieces_upto(phase)
        by_leaf: dict[int, list[Piece]] = {}
        for piece in pieces:
            by_leaf.setdefault(piece.leaf, []).append(piece)
        grad_blocks: dict[tuple[int, BlockKey, int], np.ndarray] = {}
        for piece, g in zip(pieces, grads):
            layout = plan.params[piece.leaf]
            for shard in g.addressable_shards:
                if shard.replica_id == 0:
                    key = block_key(layout.block_of(normalize_index(shard.index, g.shape), piece))
                    grad_blocks[(piece.leaf, key, piece.start)] = np.asarray(shard.data)
        n = len(plan.params)
        dummy_state = self.programs.dummy_state(phase)
        params_in, grads_in, state_in = [], [], []
        for k, layout in enumerate(plan.params):
            if k in by_leaf:
                ranges = sorted(by_leaf[k])
                params_in.append(self._gather(layout, self.buffers.params[k], ranges))
                grads_in.append(self._gather(layout, None, ranges, grad_blocks, k))
            else:
                params_in.append(self.programs.dummy(layout))
                grads_in.append(self.programs.dummy(layout))
        shared_iter = iter(self.shared)
        for j, (layout, owner) in enumerate(zip(plan.state, plan.analysis.state_owner)):
            if owner is None:
                state_in.append(next(shared_iter))
            elif owner in by_leaf:
                ranges = [self.plan.state_piece(j, p) for p in sorted(by_leaf[owner])]
                state_in.append(self._gather(layout, self.buffers.state[j], ranges))
            else:
                state_in.append(dummy_state[j])
        outs = self.programs.run([*params_in, *state_in, *grads_in], injected)
        self.replayed_bytes += sum(params_in[k].nbytes for k in by_leaf) + sum(
            state_in[j].nbytes for j, owner in enumerate(plan.analysis.state_owner) if owner in by_leaf)
        new_params, new_state = outs[:n], outs[n:]
        for k in by_leaf:
            ranges = sorted(by_leaf[k])
            self._scatter(plan.params[k], self.buffers.params[k], ranges, new_params[k])
        for j, owner in enumerate(plan.analysis.state_owner):
            if owner in by_leaf:
                ranges = [self.plan.state_piece(j, p) for p in sorted(by_leaf[owner])]
                self._scatter(plan.state[j], self.buffers.state[j], ranges, new_state[j])
        self.shared_after_replay = [np.asarray(new_state[j]) for j in plan.analysis.shared_state]

    def _gather(self, layout: LeafLayout, blocks: dict[BlockKey, np.ndarray] | None, ranges: list[Piece],
                grad_blocks: dict | None = None, leaf: int | None = None) -> np.ndarray:
        """The replay input of one leaf: its rows in the given pieces, block by block.

        Chunked (elementwise) updates take the row ranges of every block stacked along
        axis 0; whole-leaf updates take the leaf assembled in its global shape.
        """
        keys = [block_key(b) for b in layout.blocks]

        def part(key: BlockKey, piece: Piece) -> np.ndarray:
            if grad_blocks is not None:
                return grad_blocks[(leaf, key, piece.start)]
            return blocks[key][piece.start:piece.stop] if layout.shape else blocks[key]

        if not self.plan.chunked:
            if len(keys) == 1:
                return part(keys[0], ranges[0])
            out = np.empty(layout.shape, layout.dtype)
            for index, key in zip(layout.blocks, keys):
                out[index] = part(key, ranges[0])
            return out
        parts = [part(key, p) for key in keys for p in ranges]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def _scatter(self, layout: LeafLayout, blocks: dict[BlockKey, np.ndarray], ranges: list[Piece],
                 value: Any) -> None:
        value = np.asarray(value)
        keys = [block_key(b) for b in layout.blocks]
        if not self.plan.chunked:
            if len(keys) == 1:
                np.copyto(blocks[keys[0]], value.reshape(blocks[keys[0]].shape))
                return
            for index, key in zip(layout.blocks, keys):
                np.copyto(blocks[key], value[index])
            return
        offset = 0
        for key in keys:
            for p in ranges:
                rows = p.stop - p.start
                if layout.shape:
                    np.copyto(blocks[key][p.start:p.stop], value[offset:offset + rows])
                else:
                    np.copyto(blocks[key], value)
                offset += rows

    def result(self) -> tuple[Any, Any, Any]:
        """(params, opt_state, extras) of version V as trees of :class:`HostArray`."""
        if not self.complete:
            raise WindowAborted(f"window for step {self.version} is incomplete")
        plan = self.plan
        return (jax.tree.unflatten(plan.params_def, [host_array(l, b) for l, b in zip(plan.params, self.buffers.params)]),
                jax.tree.unflatten(plan.state_def, [host_array(l, b) for l, b in zip(plan.state, self.buffers.state)]),
                jax.tree.unflatten(plan.extras_def, [host_array(l, b) for l, b in zip(plan.extras, self.buffers.extras)]))


class ReplayPrograms:
    """The jitted CPU replay of one plan, and the dummy leaves that keep its tree whole.

    One program serves every phase: ``jax.jit`` compiles once per input shape set, i.e.
    once per phase, and the cache lives as long as the plan.
    """

    def __init__(self, plan: CapturePlan):
        self.plan = plan
        self.cpu = jax.local_devices(backend="cpu")[0]  # this process's (multi-process CPU jobs)
        n, m = len(plan.params), len(plan.state)
        flat = flat_update_fn(plan.update, plan.params_def, plan.state_def)
        tokens = input_tokens(n, m)

        signature = plan.analysis.cut_signature

        def run(args, injected):
            outs, _ = interpret(flat, "inject", args, tokens, injected, signature)
            # Returning the injected scalars gives each one the extra use it has on the
            # device (where it is also shipped out): XLA:CPU rewrites a division by a
            # broadcast scalar differently when the scalar has a single use.
            return [o.value for o in outs], list(injected)

        self._run = jax.jit(run)
        self._dummy_state: dict[int, list[np.ndarray]] = {}

    def dummy(self, layout: LeafLayout) -> np.ndarray:
        """Stand-in for a leaf that is not being advanced. One row when leaves are chunked
        (elementwise updates do not look at shapes); the full shape otherwise, because
        per-leaf optimizers choose their code path by shape (adafactor factors only large
        matrices), and the host must run the device's code path to match its scalars."""
        if not layout.shape:
            return np.zeros((), layout.dtype)
        if self.plan.chunked:
            return np.zeros((1,) + tuple(layout.block_shape[1:]), layout.dtype)
        return np.zeros(layout.shape, layout.dtype)

    def dummy_state(self, phase: int) -> list[np.ndarray]:
        """Zeros shaped like the optimizer state of the reduced tree of ``phase``."""
        if phase not in self._dummy_state:
            plan = self.plan
            avals = [jax.ShapeDtypeStruct(self.dummy(layout).shape, layout.dtype) for layout in plan.params]
            abstract = jax.eval_shape(plan.tx.init, jax.tree.unflatten(plan.params_def, avals))
            self._dummy_state[phase] = [np.zeros(a.shape, a.dtype) for a in jax.tree.leaves(abstract)]
        return self._dummy_state[phase]

    def check(self) -> None:
        """Trace every phase's replay abstractly, so a plan the host cannot replay exactly
        is rejected before the first window rather than in the middle of one."""
        plan = self.plan
        injected = [jax.ShapeDtypeStruct((), np.dtype(dtype)) for _, dtype in plan.analysis.cut_signature]
        for phase in range(plan.k - 1):
            present: dict[int, int] = {}
            for piece in plan.slicing.pieces_upto(phase):
                present[piece.leaf] = present.get(piece.leaf, 0) + piece.stop - piece.start
            params = []
            for k, layout in enumerate(plan.params):
                if k in present and plan.chunked and layout.shape:
                    shape = (present[k] * len(layout.blocks),) + tuple(layout.block_shape[1:])
                else:
                    shape = self.dummy(layout).shape
                params.append(jax.ShapeDtypeStruct(shape, layout.dtype))
            state = jax.eval_shape(plan.tx.init, jax.tree.unflatten(plan.params_def, params))
            args = [*params, *jax.tree.leaves(state), *params]
            jax.eval_shape(self._run, args, injected)

    def run(self, args: list[np.ndarray], injected: list[np.ndarray]) -> list[jax.Array]:
        with jax.default_device(self.cpu):
            return self._run(args, injected)[0]
