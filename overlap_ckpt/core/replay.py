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

Host memory (issue 20): a phase holds the host copy, its outbox until each part is used
(the captured slice until its first replay, each slice's gradient pieces until they are
applied), and, for whole-leaf plans, one replay call's outputs. Replay calls are cut per
slice, so the calls of slice ``i`` are the same at every later phase and in every window:
with row chunks every call of a slice has the same shapes, and the replay compiles one
program per slice (:class:`Chunk`). Each compiled program keeps several MiB of host
memory, and a window of K=3 on a 20M LM compiled 15 of them when calls were cut per phase.

With row chunks the host copy of the replayed slices *is* the replay calls' outputs
(:attr:`HostBuffers.calls`): the first call over some rows reads the captured arrays in
place, and every later call over them donates the outputs of the one before and runs in
place. Copying the captured slice in and every output back cost 4.3x the state's bytes
per phase against 2.3x without (the replay ran at 31-37% of a memcpy).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import WindowAborted
from ..gil import yielding
from ..hostarray import HostShard, index_key, normalize_index
from . import backend, scalars
from .ticket import Outbox
from .buffers import (MOVED, XLA_ALIGNMENT, BlockKey, HostBuffers, host_array, replicated_value, rows_of,
                      store_piece, trim_host_memory, unlead)
from .interp import InterpretError, interpret
from .plan import CapturePlan, LeafLayout, part_rows
from .separability import blame, flat_update_fn, input_tokens
from .slicing import Piece

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One leaf's share of a replay call: the rows the call computes (``rows``) and the
    rows it writes back into the host copy (``keep``, a sub-range, empty when the call has
    nothing new of this leaf).

    Why they differ: every call of a slice takes the same number of rows of each of its
    leaves, so that one compiled program serves them all. A leaf whose rows run out before
    the slice's last call computes its last rows again, in its own buffers (from the
    captured values, then from its own outputs), and those rows are not kept. That is
    exact only for row-separable updates, which is what a chunked plan is; whole-leaf
    plans compute and keep whole leaves.
    """

    rows: Piece
    keep: Piece


GradParts = dict[tuple[int, BlockKey], list[tuple[Piece, np.ndarray]]]
CallLeaf = tuple[str, LeafLayout, Chunk]  # ("params" or "state", its layout, its rows in the call)

# Why a window's steps do not line up, and what the loop must do: said wherever that is found.
UNREPORTED_STEP = ("A step was not reported, or the state changed outside the optimizer: call "
                   "mngr.step(state) after every step; use optax.apply_if_finite, not a restored old state")


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
        # Chunked plans: the captured slice of this phase as views by (leaf, block), read by
        # the first call over each of its rows and dropped after them.
        self._captured: dict[str, GradParts] | None = None
        # Chunked plans: the addresses of the buffers each call of this phase donated, which
        # its outputs must reuse (else the host holds one copy more: _warn_new_memory).
        self._reused: dict[tuple[int, int], list[int]] = {}
        self.replayed_bytes = 0  # bytes of params + owned state advanced by replay
        self.apply_seconds = 0.0  # time in replay calls (gather, run, any write back), copy-in excluded

    @property
    def complete(self) -> bool:
        return self.next_phase == self.plan.k

    def receive(self, outbox: Outbox) -> None:
        plan, phase = self.plan, outbox.ticket.phase
        if phase != self.next_phase:
            raise WindowAborted(f"phase {phase} arrived where {self.next_phase} was due. {UNREPORTED_STEP}")
        last = phase == plan.k - 1
        # The outbox is the window's now: each captured array is dropped as soon as it is
        # used (the slice once copied in, or with row chunks once its first calls have read
        # it; gradient pieces once applied), not at the end of the phase, so that the host
        # never holds a slice twice while the replay runs.
        captured, outbox.state = outbox.state, []
        targets = [(kind, piece) for p in plan.slicing.slices[phase] for kind, piece in (
            ("params", p), *(("state", plan.state_piece(j, p)) for j in plan.analysis.owned_state(p.leaf)))]
        if plan.chunked and not last:
            self._captured = {"params": {}, "state": {}}
        for i, (kind, piece) in yielding(enumerate(targets)):
            if plan.chunked and not last:
                _add_parts(self._captured[kind], getattr(plan, kind)[piece.leaf], piece, captured[i])
            else:
                store_piece(getattr(self.buffers, kind)[piece.leaf], captured[i], piece, adopt=last)
            captured[i] = None
        self.shared = [replicated_value(x, plan.state[j].shape)
                       for j, x in zip(plan.analysis.shared_state, outbox.shared)]
        self._check_shared_version(phase)
        if phase < plan.k - 1:
            packed = [replicated_value(g, (-1,)) for g in outbox.globals]
            grads, outbox.grads = outbox.grads, []
            self._replay(phase, grads, scalars.unpack(packed, plan.analysis.shipped_signature))
            # Captured arrays and replay outputs are freed in pieces below glibc's mmap
            # threshold: without a trim their pages stay in malloc's arenas (measured on the
            # 20M LM, K=3: ~1.4x the state still resident between windows).
            trim_host_memory()
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
                raise WindowAborted(f"optimizer counters are {replayed.tolist()} after replay, "
                                    f"{fresh.tolist()} on the device. {UNREPORTED_STEP}")

    def _replay(self, phase: int, grads: list[jax.Array], injected: list[np.ndarray]) -> None:
        """Apply this phase's gradient to slices 0..``phase``, slice by slice; each slice's
        gradient pieces are released (``grads`` is emptied) once its calls have run."""
        slices = self.plan.slicing.slices
        first, start = 0, time.perf_counter()
        for i in range(phase + 1):
            stop = first + len(slices[i])
            parts = self._grad_parts(slices[i], grads[first:stop])
            grads[first:stop] = [None] * (stop - first)
            for b, batch in enumerate(self.programs.slice_batches(i)):
                if self.plan.chunked:
                    self._advance((i, b), batch, parts, injected, first_run=i == phase)
                else:
                    self._replay_batch(batch, parts, injected)
            del parts
            first = stop
        # Until its call has run, XLA holds what a call reads: without the wait the captured
        # slice outlived its phase (measured: a third of the state more at the next phase).
        jax.block_until_ready(self.buffers.calls)
        if any(_addresses(self.buffers.calls[call]) != wanted for call, wanted in self._reused.items()):
            _warn_new_memory()
        self._reused.clear()
        self._captured = None
        self.apply_seconds += time.perf_counter() - start

    def _grad_parts(self, pieces: tuple[Piece, ...], grads: list[jax.Array]) -> GradParts:
        """The captured gradient of each piece, by (leaf, host block): views, not copies."""
        parts: GradParts = {}
        for piece, g in zip(pieces, grads):
            _add_parts(parts, self.plan.params[piece.leaf], piece, g)
        return parts

    def _advance(self, call: tuple[int, int], batch: tuple[Chunk, ...], grad_parts: GradParts,
                 injected: list[np.ndarray], *, first_run: bool) -> None:
        """One replay call of a chunked plan, whose outputs are the host copy of its rows.

        The first run in a window reads the captured rows in place and writes into the
        outputs this call had in the window the copy was last used for (when the pool gave
        it back; else new memory). Every later run donates the call's own outputs: XLA
        updates them in place. Each call keeps its own rows, lockstep repeats included (see
        :class:`Chunk`), so a repeated row is computed from the same values as the kept one."""
        plan = self.plan
        by_leaf, owned = self.programs.leaves_of(batch)
        grads_in = {k: self._gather(plan.params[k], None, c.rows, grad_parts) for k, c in by_leaf.items()}
        if first_run:
            captured = self._captured
            moving = [*(self._gather(plan.params[k], None, c.rows, captured["params"]) for k, c in by_leaf.items()),
                      *(self._gather(plan.state[j], None, plan.state_piece(j, c.rows), captured["state"])
                        for j, c in owned.items())]
            reuse = self.buffers.calls.pop(call, None)
        else:
            moving, reuse = self.buffers.calls.pop(call), None
        donated = reuse if first_run else moving
        if donated is not None:  # checked once the phase's calls have run (see _replay)
            self._reused[call] = _addresses(donated)
        params_in = dict(zip(by_leaf, moving))
        state_in = dict(zip(owned, moving[len(by_leaf):]))
        args = self.programs.arguments(params_in, state_in, grads_in, self.shared)
        del moving, params_in, state_in, grads_in
        n = len(plan.params)
        advanced = [*by_leaf, *(n + j for j in owned)]
        outs, shared = self.programs.run(args, injected, advanced, reuse, in_place=not first_run)
        del args, donated
        self.buffers.calls[call] = outs
        self.replayed_bytes += sum(self.programs.bytes_of(c.keep) for c in by_leaf.values())
        self.shared_after_replay = [np.asarray(x) for x in shared]

    def _replay_batch(self, batch: tuple[Chunk, ...], grad_parts: GradParts, injected: list[np.ndarray]) -> None:
        """One replay call over ``batch`` of a whole-leaf plan: its inputs are the host
        blocks (assembled when a leaf has several), its outputs are copied back into them.
        Whole leaves differ in shape from call to call, so no output buffer is kept."""
        plan = self.plan
        by_leaf, owned = self.programs.leaves_of(batch)
        params_in = {k: self._gather(plan.params[k], self.buffers.params[k], c.rows) for k, c in by_leaf.items()}
        grads_in = {k: self._gather(plan.params[k], None, c.rows, grad_parts) for k, c in by_leaf.items()}
        state_in = {j: self._gather(plan.state[j], self.buffers.state[j], plan.state_piece(j, c.rows))
                    for j, c in owned.items()}
        args = self.programs.arguments(params_in, state_in, grads_in, self.shared)
        n = len(plan.params)
        del params_in, state_in, grads_in
        outs, shared = self.programs.run(args, injected, [*by_leaf, *(n + j for j in owned)])
        del args
        params_out, state_out = outs[:len(by_leaf)], outs[len(by_leaf):]
        for (k, c), out in zip(by_leaf.items(), params_out):
            _scatter(plan.params[k], self.buffers.params[k], out)
            self.replayed_bytes += self.programs.bytes_of(c.keep)
        for j, out in zip(owned, state_out):
            _scatter(plan.state[j], self.buffers.state[j], out)
        self.shared_after_replay = [np.asarray(x) for x in shared]

    def _gather(self, layout: LeafLayout, blocks: Any, rows: Piece, grad_parts: GradParts | None = None) -> np.ndarray:
        """The replay input of one leaf: ``rows`` of each of its blocks (of the host copy,
        or of captured pieces with ``grad_parts``), stacked along axis 0; a view when the
        leaf has one block. Whole-leaf plans take the leaf in its global shape."""
        keys = [index_key(b) for b in layout.blocks]

        def part(key: BlockKey) -> np.ndarray:
            if grad_parts is None:
                return blocks[key][rows.start:rows.stop] if layout.shape else blocks[key]
            for captured, data in grad_parts[(rows.leaf, key)]:
                if captured.start <= rows.start and rows.stop <= captured.stop:
                    return data[rows.start - captured.start:rows.stop - captured.start] if layout.shape else data
            raise WindowAborted(f"no captured gradient holds rows {rows.start}:{rows.stop} of leaf {rows.leaf}")

        if len(keys) == 1:
            return part(keys[0])
        if not keys:  # replica 0 of every block is on other processes: nothing of it is kept here
            return np.zeros(self.programs.gathered(layout, rows).shape, layout.dtype)
        if not self.plan.chunked:
            out = np.empty(layout.shape, layout.dtype)
            for index, key in zip(layout.blocks, keys):
                out[index] = part(key)
            return out
        return np.concatenate([part(key) for key in keys], axis=0)

    def result(self) -> tuple[Any, Any, Any]:
        """(params, opt_state, extras) of version V as trees of :class:`HostArray`."""
        if not self.complete:
            raise WindowAborted(f"window for step {self.version} is incomplete")
        plan = self.plan
        replayed = self._replayed_rows()
        return (jax.tree.unflatten(plan.params_def, [host_array(b, replayed.get(("params", k), []))
                                                     for k, b in yielding(enumerate(self.buffers.params))]),
                jax.tree.unflatten(plan.state_def, [host_array(b, replayed.get(("state", j), []))
                                                    for j, b in yielding(enumerate(self.buffers.state))]),
                jax.tree.unflatten(plan.extras_def, [host_array(b) for b in self.buffers.extras]))

    def _replayed_rows(self) -> dict[tuple[str, int], list[HostShard]]:
        """Chunked plans: the rows each replay call keeps, as views of its outputs, by leaf."""
        rows: dict[tuple[str, int], list[HostShard]] = {}
        for call, outs in yielding(self.buffers.calls.items()):
            batch = self.programs.slice_batches(call[0])[call[1]]
            for (kind, layout, chunk), value in zip(self.programs.call_leaves(batch), outs):
                rows.setdefault((kind, chunk.rows.leaf), []).extend(_kept(layout, chunk, value))
        return rows


def _addresses(arrays: list[jax.Array]) -> list[int]:
    """Where each shard of ``arrays`` lies (a loop with a mesh set makes the replay's
    outputs sharded over the CPU devices)."""
    return [shard.data.unsafe_buffer_pointer() for x in arrays for shard in x.addressable_shards]


_warned_new_memory = False


def _warn_new_memory() -> None:
    """Once per process: the replay's outputs went to new memory instead of the buffers they
    reuse. JAX does not donate a buffer that a numpy view still references, and says nothing;
    the copy is still exact, but the host then holds one more copy per window, beyond what
    ``max_host_bytes`` accounts for."""
    global _warned_new_memory
    if not _warned_new_memory:
        _warned_new_memory = True
        log.warning("the host replay wrote a checkpoint into new memory instead of reusing its buffers: "
                    "something still holds numpy views of an earlier host copy (a Sink that keeps the tree it "
                    "was given must list its step in busy_steps() for as long). Host memory grows by up to a "
                    "copy of the state per window.")


def _add_parts(parts: GradParts, layout: LeafLayout, piece: Piece, captured: jax.Array) -> None:
    """Add the blocks of a captured ``piece`` of a leaf to ``parts`` by (leaf, host block):
    views, not copies."""
    x = unlead(captured, len(layout.shape))
    want = (piece.stop - piece.start,) + tuple(layout.block_shape[1:]) if layout.shape else ()
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            if tuple(shard.data.shape) != want:
                raise WindowAborted(f"a captured piece of leaf {piece.leaf} arrived in blocks of shape "
                                    f"{tuple(shard.data.shape)} where {want} was planned. {MOVED}")
            key = index_key(layout.block_of(normalize_index(shard.index, x.shape), piece))
            parts.setdefault((piece.leaf, key), []).append((piece, np.asarray(shard.data)))


def _kept(layout: LeafLayout, chunk: Chunk, value: jax.Array) -> list[HostShard]:
    """The ``keep`` rows of a call's output for one leaf (computed over ``chunk.rows``, its
    blocks stacked along axis 0), as views with their global indices."""
    rows, keep = chunk.rows, chunk.keep
    if keep.stop == keep.start:
        return []
    data = np.asarray(value)
    if not layout.shape:
        return [HostShard((), data)]
    n, lo, hi = rows.stop - rows.start, keep.start - rows.start, keep.stop - rows.start
    return [HostShard(rows_of(block, keep), data[i * n + lo:i * n + hi]) for i, block in enumerate(layout.blocks)]


def _scatter(layout: LeafLayout, blocks: Any, value: Any) -> None:
    """Copy a whole-leaf call's output for one leaf (in the leaf's global shape when it has
    several blocks) into the host blocks."""
    value = np.asarray(value)
    keys = [index_key(b) for b in layout.blocks]
    if len(keys) == 1:
        np.copyto(blocks[keys[0]], value.reshape(blocks[keys[0]].shape))
        return
    for index, key in zip(layout.blocks, keys):
        np.copyto(blocks[key], value[index])


def call_bytes(plan: CapturePlan) -> int:
    """About how many bytes of params and owned state one replay call advances.

    Why larger calls with row chunks: there a call's inputs are views and its outputs are
    the host copy, so its size costs no memory, and each call has a fixed cost (dispatching
    ~80 arguments, XLA's threads) that small calls pay many times: on the 20M LM, K=3,
    calls of 12 MB ran at 34% of a memcpy, of 40 MB at 45%, of 60 MB at 55%. Whole-leaf
    calls get fresh outputs that are copied back, so they stay small."""
    if plan.chunked:
        return int(min(max(plan.state_bytes // 4, 4 << 20), 256 << 20))
    return int(min(max(plan.state_bytes // 20, 4 << 20), 64 << 20))


def _lockstep(pieces: tuple[Piece, ...], row_bytes, limit: int, align=lambda leaf: 1) -> list[tuple[Chunk, ...]]:
    """Row chunks of ``pieces`` in calls of about ``limit`` bytes, every call taking the
    same number of rows of every piece (see :class:`Chunk`): one program for all calls.
    The rows a call keeps of a leaf start at multiples of ``align(leaf)`` rows from the
    piece's start (see :func:`overlap_ckpt.core.plan.part_rows`)."""
    total = sum((p.stop - p.start) * row_bytes(p.leaf) for p in pieces)
    calls = max(1, -(-total // max(limit, 1)))
    out = []
    for b in range(calls):
        batch = []
        for p in pieces:
            n, a = p.stop - p.start, align(p.leaf)
            per_call = -(-n // calls)
            c = min(n, -(-per_call // a) * a)  # rows per call, rounded up to a multiple of a
            start, stop = p.start + min(b * c, n), min(p.start + (b + 1) * c, p.stop)
            lo = min(start, p.stop - c)
            batch.append(Chunk(Piece(p.leaf, lo, lo + c), Piece(p.leaf, start, max(start, stop))))
        out.append(tuple(batch))
    return out


def _grouped(pieces: tuple[Piece, ...], piece_bytes, limit: int) -> list[tuple[Chunk, ...]]:
    """Whole-leaf pieces grouped into calls of at most ``limit`` bytes (a larger piece is
    a call alone)."""
    batches: list[list[Chunk]] = [[]]
    filled = 0
    for piece in pieces:
        if batches[-1] and filled + piece_bytes(piece) > limit:
            batches.append([])
            filled = 0
        batches[-1].append(Chunk(piece, piece))
        filled += piece_bytes(piece)
    return [tuple(b) for b in batches if b]


class ReplayPrograms:
    """The jitted CPU replay of one plan, and the dummy leaves that keep its tree whole.

    ``jax.jit`` compiles once per input shape set, and the cache lives as long as the
    plan: the calls of slice ``i`` are the same at every phase (see :meth:`slice_batches`),
    so a chunked plan compiles one program per slice, a whole-leaf plan one per group of
    leaves, and no phase or later window compiles again.
    """

    def __init__(self, plan: CapturePlan):
        self.plan = plan
        self.cpu = backend.replay_device() if plan.k > 1 else None  # K=1 replays nothing
        n, m = len(plan.params), len(plan.state)
        flat = self._flat = flat_update_fn(plan.update, plan.params_def, plan.state_def)
        tokens = input_tokens(n, m)

        signature, read = plan.analysis.cut_signature, plan.analysis.cut_read

        shared = [n + j for j in plan.analysis.shared_state]

        def run(moving, fixed, injected, reuse, true):
            del reuse  # donated: XLA writes the outputs into these buffers (see :meth:`run`)
            moving = iter(moving)
            args = [next(moving) if x is None else x for x in fixed]
            barrier = host_cut_barrier(true) if plan.platform == "cpu" else None
            outs, interp = interpret(flat, "inject", args, tokens, injected, signature, read, barrier)
            outs = [o.value for o in outs]
            advanced = _advanced(fixed)
            # What the host keeps comes first; the stand-ins' updates are dead code, which XLA
            # removes (see :meth:`run`), unless the update branches or loops: XLA then drops
            # the unused results of a branch and compiles what stays in it otherwise than
            # the device does (a scalar left with one reader, see below), so they stay.
            kept = {*advanced, *shared}
            alive = [o for x, o in enumerate(outs) if x not in kept] if interp.branches else []
            # The values returned besides are there for the uses they have on the device, which
            # XLA:CPU compiles otherwise than a value with fewer: the injected scalars (shipped
            # out on the device), and those of Interpreter.kept_apart.
            return (([outs[x] for x in advanced], [outs[x] for x in shared], alive),
                    [*injected, *interp.kept_apart()])

        # keep_unused: jit drops arguments the program does not read, and a dropped
        # argument is not donated (the outputs would go to fresh memory again).
        self._run = jax.jit(run, donate_argnums=3, keep_unused=True)
        self._run_in_place = jax.jit(run, donate_argnums=0, keep_unused=True)

        def zeros(signature):  # the plan's own function: jit caches by function, so its
            return _zeros(signature)  # programs are freed with the plan, as run's are

        self._zeros = jax.jit(zeros, static_argnums=0)
        self._dummy_state: list[np.ndarray] | None = None
        self._stand_ins: tuple[list[jax.Array], list[jax.Array]] | None = None
        self.batch_bytes = call_bytes(plan)
        self._batches = [self._make_batches(i) for i in range(plan.k - 1)]

    def unit_row_bytes(self, leaf: int) -> int:
        """Bytes of one row of a parameter leaf and of the state leaves it owns."""
        plan = self.plan
        return plan.params[leaf].row_bytes + sum(plan.state[j].row_bytes for j in plan.analysis.owned_state(leaf))

    def _piece_bytes(self, piece: Piece) -> int:
        plan = self.plan
        return (plan.params[piece.leaf].rows * plan.params[piece.leaf].row_bytes
                + sum(plan.state[j].rows * plan.state[j].row_bytes for j in plan.analysis.owned_state(piece.leaf)))

    def _make_batches(self, i: int) -> list[tuple[Chunk, ...]]:
        pieces = self.plan.slicing.slices[i]
        if self.plan.chunked:
            return _lockstep(pieces, self.unit_row_bytes, self.batch_bytes,
                             lambda leaf: part_rows(self.plan.params[leaf]))
        return _grouped(pieces, self._piece_bytes, self.batch_bytes)

    def slice_batches(self, i: int) -> list[tuple[Chunk, ...]]:
        """The replay calls that advance slice ``i`` (of a window that is not its last
        slice) by one step: its pieces in calls of about :attr:`batch_bytes` (params +
        owned state), so that the replay's scratch stays bounded whatever K and the
        state's size. Phase ``j`` runs the calls of slices 0..j."""
        return self._batches[i]

    def scratch_bytes(self) -> int:
        """The most host memory a phase holds besides the host copy: its outbox (the
        captured slice until its first replay, the gradient pieces of slices 0..j until
        they are applied), one replay call's copies of its inputs, and besides: with row
        chunks, the rows two calls both compute (the copy is the calls' outputs, see
        :class:`Chunk`); else one call's outputs."""
        plan = self.plan
        batches = [batch for slice_batches in self._batches for batch in slice_batches]

        def rows(batch) -> int:
            return sum(self.bytes_of(c.rows) for c in batch)

        most_call = max(map(self._input_copies, batches), default=0)
        if plan.chunked:
            outputs = sum(rows(batch) - sum(self.bytes_of(c.keep) for c in batch) for batch in batches)
        else:
            outputs = max(map(rows, batches), default=0)
        most_outbox = max((sum(self.bytes_of(p) for p in plan.slicing.slices[j])
                           + sum(self._grad_bytes(p) for p in plan.slicing.pieces_upto(j))
                           for j in range(plan.k - 1)), default=0)
        return most_outbox + most_call + outputs

    def _input_copies(self, batch: tuple[Chunk, ...]) -> int:
        """Bytes of the inputs a call over ``batch`` copies: whole-leaf calls, all of them
        (counted whole: leaves of several blocks are assembled); chunked calls, those of
        leaves of several blocks (stacked) or whose row chunks may start off the alignment
        XLA needs to read numpy memory in place. The others are views."""
        if not self.plan.chunked:
            return sum(self.bytes_of(c.rows) + self._grad_bytes(c.rows) for c in batch)
        copied = 0
        for kind, layout, chunk in self.call_leaves(batch):
            if len(layout.blocks) > 1 or layout.row_bytes % XLA_ALIGNMENT:
                copied += layout.row_bytes * (chunk.rows.stop - chunk.rows.start) * (2 if kind == "params" else 1)
        return copied

    def bytes_of(self, piece: Piece) -> int:
        """Bytes of a piece of a parameter leaf and of the state leaves it owns."""
        if self.plan.chunked:
            return self.unit_row_bytes(piece.leaf) * (piece.stop - piece.start)
        return self._piece_bytes(piece)

    def _grad_bytes(self, piece: Piece) -> int:
        return self.plan.params[piece.leaf].row_bytes * (piece.stop - piece.start)

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

    def dummy_state(self) -> list[np.ndarray]:
        """Zeros shaped like the optimizer state of the tree of stand-ins."""
        if self._dummy_state is None:
            plan = self.plan
            avals = [jax.ShapeDtypeStruct(self.dummy(layout).shape, layout.dtype) for layout in plan.params]
            abstract = jax.eval_shape(plan.tx.init, jax.tree.unflatten(plan.params_def, avals))
            self._dummy_state = [np.zeros(a.shape, a.dtype) for a in jax.tree.leaves(abstract)]
        return self._dummy_state

    def stand_ins(self) -> tuple[list[Any], list[Any]]:
        """The stand-ins of every params leaf and every state leaf, as :meth:`arguments`
        passes them.

        Why they are JAX arrays, made once, when leaves are chunked: most arguments of a
        call are stand-ins (a call of the 20M LM, K=3, advances 7 of 19 leaves: 49 of its
        77 arguments are one-row zeros), and ``jit`` wraps every numpy argument into a
        buffer at each call, about 10 µs apiece even without a copy. Whole-leaf stand-ins
        stay fresh numpy zeros: they are full-sized, and untouched ``np.zeros`` pages cost
        no host memory between calls, which a cached buffer would.
        """
        if self._stand_ins is None:
            plan = self.plan
            stand_ins = ([self.dummy(layout) for layout in plan.params], list(self.dummy_state()))
            if not plan.chunked:
                return stand_ins
            with jax.default_device(self.cpu):  # uncommitted, as numpy arguments are: the same programs
                self._stand_ins = jax.tree.map(jnp.asarray, stand_ins)
        return self._stand_ins

    def arguments(self, params_in: dict[int, Any], state_in: dict[int, Any], grads_in: dict[int, Any],
                  shared: list) -> list:
        """The flat replay arguments of one call: the given leaves (by index), the shared
        state leaves as the device reported them, and stand-ins for the rest."""
        plan = self.plan
        params_stand_in, state_stand_in = self.stand_ins()
        params = [params_in.get(k, params_stand_in[k]) for k in range(len(plan.params))]
        grads = [grads_in.get(k, params_stand_in[k]) for k in range(len(plan.params))]
        shared_iter = iter(shared)
        state = []
        for j, owner in enumerate(plan.analysis.state_owner):
            state.append(next(shared_iter) if owner is None else state_in.get(j, state_stand_in[j]))
        return [*params, *state, *grads]

    def rehearse(self) -> None:
        """Trace every replay call a window makes, on the real shapes.

        Why before training: an optimizer the host cannot replay on slices (state leaves
        shaped unlike what a slice gives them, shape-dependent code paths) must be refused
        when the manager is prepared, not on the replay thread at the first window. Tracing
        (no compile, no data) finds those; the programs compile on the replay thread, or
        ahead with :meth:`compile`. The calls of a slice are the same at every phase, so
        each is traced once.
        """
        plan = self.plan
        for i, args, injected, advanced in self._calls():
            with blame(self._flat, args, f"on slice {i} of a window",
                       f"rehearsing the host replay of slice {i} of a window"):
                (outs, _, _), _ = jax.eval_shape(self._run, *_split(args, advanced), injected,
                                                 [args[x] for x in advanced], TRUE)
            for x, out in zip(advanced, outs):
                if x < len(plan.params) and tuple(out.shape) != args[x].shape:
                    raise InterpretError(f"the replay of a slice returns params of shape "
                                         f"{tuple(out.shape)} for an input of shape {args[x].shape}")

    def compile(self) -> None:
        """Compile every replay program before the first window (``compile_ahead``).

        Why: compiled on the replay thread at the first window, they add XLA's working
        memory to the window's own, and glibc keeps most of it after the compile (a probe
        of the 20M LM, K=3: the first window's RSS ~0.6x the state above the later ones';
        the benchmark's peak RSS moved by less than its run-to-run noise). Compiled here,
        :meth:`OverlapEngine.compile_replay` returns that memory before any window. With
        row chunks each call has two programs: its first run and its in-place runs."""
        with jax.default_device(self.cpu):
            for _, args, injected, advanced in self._calls():
                moving, fixed = _split(args, advanced)
                self._run.lower(moving, fixed, injected, list(moving), TRUE).compile()
                self._zeros.lower(_signature(moving)).compile()
                if self.plan.chunked:
                    self._run_in_place.lower(moving, fixed, injected, [], TRUE).compile()

    def _calls(self):
        """``(slice, args, injected, advanced)`` of one replay call per distinct program, as
        abstract arrays: the arguments of :meth:`run`."""
        plan = self.plan
        n = len(plan.params)
        injected = [jax.ShapeDtypeStruct((), np.dtype(dtype)) for _, dtype in plan.analysis.shipped_signature]
        shared = [jax.ShapeDtypeStruct(plan.state[j].shape, plan.state[j].dtype) for j in plan.analysis.shared_state]
        for i, batch in ((i, batch) for i in range(plan.k - 1) for batch in self.slice_batches(i)):
            by_leaf, owned = self.leaves_of(batch)
            outputs = self.outputs_of(batch)
            params_in = dict(zip(by_leaf, outputs))
            state_in = dict(zip(owned, outputs[len(by_leaf):]))
            yield (i, self.arguments(params_in, state_in, dict(params_in), shared), injected,
                   [*by_leaf, *(n + j for j in owned)])

    def leaves_of(self, batch: tuple[Chunk, ...]) -> tuple[dict[int, Chunk], dict[int, Chunk]]:
        """The params leaves a call over ``batch`` advances (in leaf order, the order of
        their arguments and outputs: donated buffers go to the first outputs of their shape)
        and the state leaves they own, each with its owner's chunk."""
        plan = self.plan
        by_leaf = {c.rows.leaf: c for c in sorted(batch, key=lambda c: c.rows.leaf)}
        owned = {j: by_leaf[owner] for j, owner in enumerate(plan.analysis.state_owner) if owner in by_leaf}
        return by_leaf, owned

    def call_leaves(self, batch: tuple[Chunk, ...]) -> list[CallLeaf]:
        """Every leaf a call over ``batch`` advances, in the order of its outputs (params,
        then the state they own), with the rows it computes and keeps of that leaf."""
        plan = self.plan
        by_leaf, owned = self.leaves_of(batch)
        return [*(("params", plan.params[k], c) for k, c in by_leaf.items()),
                *(("state", plan.state[j], Chunk(plan.state_piece(j, c.rows), plan.state_piece(j, c.keep)))
                  for j, c in owned.items())]

    def outputs_of(self, batch: tuple[Chunk, ...]) -> list[jax.ShapeDtypeStruct]:
        """The outputs a call over ``batch`` advances, shaped as their inputs."""
        return [self.gathered(layout, chunk.rows) for _, layout, chunk in self.call_leaves(batch)]

    def gathered(self, layout: LeafLayout, rows: Piece) -> jax.ShapeDtypeStruct:
        """Shape and dtype of :meth:`WindowReplay._gather` of ``rows`` of this leaf."""
        if not layout.shape:
            shape: tuple[int, ...] = ()
        elif not self.plan.chunked:
            shape = layout.block_shape if len(layout.blocks) == 1 else layout.shape
        else:
            shape = ((rows.stop - rows.start) * len(layout.blocks),) + tuple(layout.block_shape[1:])
        return jax.ShapeDtypeStruct(shape, layout.dtype)

    def run(self, args: list[Any], injected: list[np.ndarray], advanced: list[int],
            reuse: list[jax.Array] | None = None, *,
            in_place: bool = False) -> tuple[list[jax.Array], list[jax.Array]]:
        """One replay call: (the updates of the leaves at ``advanced``, in that order and
        shaped as their inputs; the updates of the shared state leaves). The first are
        written into the buffers ``reuse`` (donated; new ones when None) or, ``in_place``,
        into the buffers of those leaves' inputs (donated).

        Why only these: the stand-ins' updates are not kept, and a program that returned
        them computed the whole optimizer over every leaf of the tree at every call (a call
        of the 20M LM, K=3, advances 7 of 19 leaves). Left unreturned, they are dead code
        that XLA removes: less work per call, and less host memory per compiled program,
        which on XLA:CPU grows with the program's operations. What the kept leaves compute
        is unchanged, bit for bit (tested against the device's update).

        Why donation: XLA:CPU puts every output of a call in fresh memory, and on this
        hardware faulting in fresh pages cost several times the update itself (a 16 MB
        chunk, alone: 40 ms for the update into fresh outputs and the copy back, 6 ms for
        the update into memory already touched, 4.5 ms in place, 3 ms for a memcpy).
        Donation changes where the outputs go, not the program. ``jit`` gives each donated
        buffer to the first output of its shape and dtype, in output order: the advanced
        leaves come first, in the order of the buffers they reuse. Buffers that something
        still views (a numpy view of a copy being persisted) are not donated by JAX: the
        outputs then go to new memory.
        """
        moving, fixed = _split(args, advanced)
        with jax.default_device(self.cpu):
            if in_place:
                outs, shared, _ = self._run_in_place(moving, fixed, injected, [], TRUE)[0]
            else:
                reuse = self._zeros(_signature(moving)) if reuse is None else reuse
                outs, shared, _ = self._run(moving, fixed, injected, reuse, TRUE)[0]
        return outs, shared


# The runtime ``true`` of every replay call (see :func:`host_cut_barrier`): an argument, so
# that XLA cannot fold the choice it makes.
TRUE = np.True_


def host_cut_barrier(true: jax.Array) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The host's barrier at a global scalar it takes from the device: the output of a
    conditional on the runtime ``true`` that picks the device's value, its other branch
    the value the host computed from its slice and stand-ins. The update reads an opaque
    scalar as on the device (:func:`overlap_ckpt.core.capture.cut_barrier`), and the
    arithmetic that computes the scalar stays in the program, feeding it as on the device."""
    def barrier(injected: jax.Array, computed: jax.Array) -> jax.Array:
        return jax.lax.cond(true, lambda a, b: a, lambda a, b: b, injected, computed)
    return barrier


def _advanced(fixed: list[Any]) -> list[int]:
    """The positions :func:`_split` took out of ``fixed`` (None there), in order."""
    return [x for x, a in enumerate(fixed) if a is None]


def _signature(arrays: list[Any]) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """Shapes and dtypes of ``arrays``, hashable: the static argument of :func:`_zeros`."""
    return tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in arrays)


def _zeros(signature: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> list[jax.Array]:
    """The first call's output buffers: zeros of ``signature`` (shapes and dtypes), jitted by
    :class:`ReplayPrograms`, one program per call.

    Why a program: its outputs are buffers XLA owns, which a later call can take by donation
    (a ``device_put`` of numpy zeros is donated but not written into); and one program per
    call, where an eager ``jnp.zeros`` per leaf compiled one per distinct leaf shape on the
    replay thread at the first window (91 compiles, 12 s, for a tree of 201 small leaves).
    Made without a device, under the replay's default device, as the stand-ins are
    (uncommitted): one replay program for the first call and the later ones, whatever mesh
    the loop has set."""
    return [jnp.zeros(shape, dtype) for shape, dtype in signature]


def _split(args: list[Any], advanced: list[int]) -> tuple[list[Any], list[Any]]:
    """(the arguments at ``advanced``, all others with None in their place): the first
    list is what the in-place program donates. Both programs trace the same function, so
    their results are the same; jit compiles it once per donation choice."""
    at = set(advanced)
    return [args[x] for x in advanced], [None if x in at else a for x, a in enumerate(args)]
