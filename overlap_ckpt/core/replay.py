"""Host side: assemble one window's slices and replay the optimizer until all reach V.

Versions (docs/design.md): slice ``i`` is captured from the state that step
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
from typing import Any

import jax
import numpy as np

from ..errors import WindowAborted
from ..hostarray import index_key, normalize_index
from . import scalars
from .capture import Outbox
from .buffers import BlockKey, HostBuffers, host_array, replicated_value, store_piece
from .interp import InterpretError, interpret
from .plan import CapturePlan, LeafLayout
from .separability import blame, flat_update_fn, input_tokens
from .slicing import Piece

log = logging.getLogger(__name__)

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

    def receive(self, outbox: Outbox) -> None:
        plan, phase = self.plan, outbox.ticket.phase
        if phase != self.next_phase:
            raise WindowAborted(f"window for step {self.version} expected phase {self.next_phase}, got {phase}")
        last = phase == plan.k - 1
        captured = iter(outbox.state)
        for piece in plan.slicing.slices[phase]:
            store_piece(self.buffers.params[piece.leaf], next(captured), piece, adopt=last)
            for j in plan.analysis.owned_state(piece.leaf):
                store_piece(self.buffers.state[j], next(captured), plan.state_piece(j, piece), adopt=last)
        self.shared = [replicated_value(x) for x in outbox.shared]
        self._check_shared_version(phase)
        if phase < plan.k - 1:
            packed = [replicated_value(g) for g in outbox.globals]
            self._replay(phase, outbox.grads, scalars.unpack(packed, plan.analysis.cut_signature))
        else:
            for layout, blocks, x in zip(plan.extras, self.buffers.extras, outbox.extras):
                store_piece(blocks, x, Piece(0, 0, layout.rows), adopt=True)
            for j, x in zip(plan.analysis.shared_state, outbox.shared):
                store_piece(self.buffers.state[j], x, Piece(j, 0, plan.state[j].rows), adopt=True)
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
        grad_parts: dict[tuple[int, BlockKey], list[tuple[Piece, np.ndarray]]] = {}
        for piece, g in zip(plan.slicing.pieces_upto(phase), grads):
            layout = plan.params[piece.leaf]
            for shard in g.addressable_shards:
                if shard.replica_id == 0:
                    key = index_key(layout.block_of(normalize_index(shard.index, g.shape), piece))
                    grad_parts.setdefault((piece.leaf, key), []).append((piece, np.asarray(shard.data)))
        for batch in self.programs.batches(phase):
            self._replay_batch(phase, batch, grad_parts, injected)

    def _replay_batch(self, phase: int, batch: tuple[Piece, ...], grad_parts: dict,
                      injected: list[np.ndarray]) -> None:
        """One replay call over ``batch`` (row ranges of some leaves), in place in the host
        blocks: its inputs are views of them where rows are contiguous, its outputs are
        copied back and dropped, so the replay holds at most one batch besides the copy."""
        plan = self.plan
        by_leaf: dict[int, list[Piece]] = {}
        for piece in batch:
            by_leaf.setdefault(piece.leaf, []).append(piece)
        params_in, grads_in, state_in = {}, {}, {}
        for k, ranges in by_leaf.items():
            params_in[k] = self._gather(plan.params[k], self.buffers.params[k], ranges)
            grads_in[k] = self._gather(plan.params[k], None, ranges, grad_parts, k)
        for j, owner in enumerate(plan.analysis.state_owner):
            if owner in by_leaf:
                state_in[j] = self._gather(plan.state[j], self.buffers.state[j],
                                           [plan.state_piece(j, p) for p in by_leaf[owner]])
        args = self.programs.arguments(phase, params_in, state_in, grads_in, self.shared)
        outs = self.programs.run(args, injected)
        self.replayed_bytes += sum(x.nbytes for x in params_in.values()) + sum(x.nbytes for x in state_in.values())
        del params_in, state_in, grads_in, args
        n = len(plan.params)
        for k, ranges in by_leaf.items():
            self._scatter(plan.params[k], self.buffers.params[k], ranges, outs[k])
        for j, owner in enumerate(plan.analysis.state_owner):
            if owner in by_leaf:
                self._scatter(plan.state[j], self.buffers.state[j],
                              [plan.state_piece(j, p) for p in by_leaf[owner]], outs[n + j])
        self.shared_after_replay = [np.asarray(outs[n + j]) for j in plan.analysis.shared_state]

    def _gather(self, layout: LeafLayout, blocks: dict[BlockKey, np.ndarray] | None, ranges: list[Piece],
                grad_parts: dict | None = None, leaf: int | None = None) -> np.ndarray:
        """The replay input of one leaf: its rows in the given pieces, block by block.

        Chunked (elementwise) updates take the row ranges of every block stacked along
        axis 0 (a view of the block when that is one run of rows); whole-leaf updates take
        the leaf assembled in its global shape.
        """
        keys = [index_key(b) for b in layout.blocks]

        def part(key: BlockKey, piece: Piece) -> np.ndarray:
            if grad_parts is None:
                return blocks[key][piece.start:piece.stop] if layout.shape else blocks[key]
            for captured, data in grad_parts[(leaf, key)]:
                if captured.start <= piece.start and piece.stop <= captured.stop:
                    return data[piece.start - captured.start:piece.stop - captured.start] if layout.shape else data
            raise WindowAborted(f"no captured gradient holds rows {piece.start}:{piece.stop} of leaf {leaf}")

        if not self.plan.chunked:
            if len(keys) == 1:
                return part(keys[0], ranges[0])
            out = np.empty(layout.shape, layout.dtype)
            for index, key in zip(layout.blocks, keys):
                out[index] = part(key, ranges[0])
            return out
        if grad_parts is None:
            ranges = _merged(ranges)
        parts = [part(key, p) for key in keys for p in ranges]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def _scatter(self, layout: LeafLayout, blocks: dict[BlockKey, np.ndarray], ranges: list[Piece],
                 value: Any) -> None:
        value = np.asarray(value)
        keys = [index_key(b) for b in layout.blocks]
        if not self.plan.chunked:
            if len(keys) == 1:
                np.copyto(blocks[keys[0]], value.reshape(blocks[keys[0]].shape))
                return
            for index, key in zip(layout.blocks, keys):
                np.copyto(blocks[key], value[index])
            return
        offset = 0
        for key in keys:
            for p in _merged(ranges):
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
        return (jax.tree.unflatten(plan.params_def, [host_array(b) for b in self.buffers.params]),
                jax.tree.unflatten(plan.state_def, [host_array(b) for b in self.buffers.state]),
                jax.tree.unflatten(plan.extras_def, [host_array(b) for b in self.buffers.extras]))


def _merged(ranges: list[Piece]) -> list[Piece]:
    """Row ranges with adjacent ones joined (the pieces of one leaf usually form one run)."""
    out: list[Piece] = []
    for p in sorted(ranges):
        if out and out[-1].stop == p.start:
            out[-1] = Piece(p.leaf, out[-1].start, p.stop)
        else:
            out.append(p)
    return out


def _batched(pieces: tuple[Piece, ...], piece_bytes, row_bytes, limit: int, chunked: bool) -> list[tuple[Piece, ...]]:
    """Pieces grouped into batches of at most ``limit`` bytes; with ``chunked`` a piece is
    cut into row ranges to fit, otherwise a piece larger than ``limit`` is a batch alone."""
    batches: list[list[Piece]] = [[]]
    filled = 0
    for piece in pieces:
        start = piece.start
        while start < piece.stop:
            per_row = row_bytes(piece.leaf)
            if chunked:
                take = min(piece.stop - start, max((limit - filled) // max(per_row, 1), 0))
                if take == 0 and not batches[-1]:
                    take = 1
            else:
                take = piece.stop - start if (filled + piece_bytes(piece) <= limit or not batches[-1]) else 0
            if take == 0:
                batches.append([])
                filled = 0
                continue
            batches[-1].append(Piece(piece.leaf, start, start + take))
            filled += take * per_row if chunked else piece_bytes(piece)
            start += take
    return [tuple(b) for b in batches if b]


class ReplayPrograms:
    """The jitted CPU replay of one plan, and the dummy leaves that keep its tree whole.

    One program serves every phase: ``jax.jit`` compiles once per input shape set, i.e.
    once per phase, and the cache lives as long as the plan.
    """

    def __init__(self, plan: CapturePlan):
        self.plan = plan
        self.cpu = jax.local_devices(backend="cpu")[0]  # this process's (multi-process CPU jobs)
        n, m = len(plan.params), len(plan.state)
        flat = self._flat = flat_update_fn(plan.update, plan.params_def, plan.state_def)
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
        self.batch_bytes = int(min(max(plan.state_bytes // 20, 4 << 20), 64 << 20))
        self._batches = [self._make_batches(phase) for phase in range(plan.k - 1)]

    def _unit_row_bytes(self, leaf: int) -> int:
        plan = self.plan
        return plan.params[leaf].row_bytes + sum(plan.state[j].row_bytes for j in plan.analysis.owned_state(leaf))

    def _piece_bytes(self, piece: Piece) -> int:
        plan = self.plan
        return (plan.params[piece.leaf].rows * plan.params[piece.leaf].row_bytes
                + sum(plan.state[j].rows * plan.state[j].row_bytes for j in plan.analysis.owned_state(piece.leaf)))

    def _make_batches(self, phase: int) -> list[tuple[Piece, ...]]:
        return _batched(self.plan.slicing.pieces_upto(phase), self._piece_bytes, self._unit_row_bytes,
                        self.batch_bytes, self.plan.chunked)

    def batches(self, phase: int) -> list[tuple[Piece, ...]]:
        """The replay calls of ``phase``: its pieces in batches of about :attr:`batch_bytes`
        (params + owned state), so that the replay's scratch stays bounded whatever K and
        the state's size. One program is compiled per batch shape, once per plan."""
        return self._batches[phase]

    def scratch_bytes(self) -> int:
        """The most host memory one replay call holds besides the host copy: gathered
        inputs (when rows are not one run), outputs, and gathered gradients."""
        plan, most = self.plan, 0
        for batches in self._batches:
            for batch in batches:
                state = sum(self._unit_row_bytes(p.leaf) * (p.stop - p.start) if plan.chunked
                            else self._piece_bytes(p) for p in batch)
                grads = sum(plan.params[p.leaf].row_bytes * (p.stop - p.start) if plan.chunked
                            else plan.params[p.leaf].rows * plan.params[p.leaf].row_bytes for p in batch)
                most = max(most, 2 * state + grads)
        return most

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

    def arguments(self, phase: int, params_in: dict[int, Any], state_in: dict[int, Any],
                  grads_in: dict[int, Any], shared: list) -> list:
        """The flat replay arguments of ``phase``: the given leaves (by index), the shared
        state leaves as the device reported them, and stand-ins for the rest."""
        plan = self.plan
        dummy_state = self.dummy_state(phase)
        params = [params_in[k] if k in params_in else self.dummy(l) for k, l in enumerate(plan.params)]
        grads = [grads_in[k] if k in grads_in else self.dummy(l) for k, l in enumerate(plan.params)]
        shared_iter = iter(shared)
        state = []
        for j, owner in enumerate(plan.analysis.state_owner):
            state.append(next(shared_iter) if owner is None else state_in.get(j, dummy_state[j]))
        return [*params, *state, *grads]

    def rehearse(self) -> None:
        """Trace every phase's replay on the real shapes, as a window would run it.

        Why before training: an optimizer the host cannot replay on slices (state leaves
        shaped unlike what a slice gives them, shape-dependent code paths) must be refused
        when the manager is prepared, not on the replay thread at the first window. Tracing
        (no compile, no data) finds those; the programs compile on the replay thread.
        """
        plan = self.plan
        injected = [jax.ShapeDtypeStruct((), np.dtype(dtype)) for _, dtype in plan.analysis.cut_signature]
        shared = [jax.ShapeDtypeStruct(plan.state[j].shape, plan.state[j].dtype) for j in plan.analysis.shared_state]
        for phase, batch in ((phase, batch) for phase in range(plan.k - 1) for batch in self.batches(phase)):
            by_leaf: dict[int, list[Piece]] = {}
            for piece in batch:
                by_leaf.setdefault(piece.leaf, []).append(piece)
            params_in = {k: self.gathered(plan.params[k], sorted(r)) for k, r in by_leaf.items()}
            state_in = {j: self.gathered(plan.state[j], [plan.state_piece(j, p) for p in sorted(by_leaf[o])])
                        for j, o in enumerate(plan.analysis.state_owner) if o in by_leaf}
            args = self.arguments(phase, params_in, state_in, dict(params_in), shared)
            with blame(self._flat, args, f"on the slices of window phase {phase}",
                       f"rehearsing the host replay of window phase {phase}"):
                outs, _ = jax.eval_shape(self._run, args, injected)
            for k, x in params_in.items():
                if tuple(outs[k].shape) != x.shape:
                    raise InterpretError(f"the replay of a slice returns params of shape "
                                         f"{tuple(outs[k].shape)} for an input of shape {x.shape}")

    def gathered(self, layout: LeafLayout, ranges: list[Piece]) -> jax.ShapeDtypeStruct:
        """Shape and dtype of :meth:`WindowReplay._gather` of ``ranges`` of this leaf."""
        if not layout.shape:
            shape: tuple[int, ...] = ()
        elif not self.plan.chunked:
            shape = layout.block_shape if len(layout.blocks) == 1 else layout.shape
        else:
            shape = (sum(p.stop - p.start for p in ranges) * len(layout.blocks),) + tuple(layout.block_shape[1:])
        return jax.ShapeDtypeStruct(shape, layout.dtype)

    def run(self, args: list[np.ndarray], injected: list[np.ndarray]) -> list[jax.Array]:
        with jax.default_device(self.cpu):
            return self._run(args, injected)[0]
