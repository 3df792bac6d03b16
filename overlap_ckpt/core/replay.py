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
(the captured slice until it is copied in, each slice's gradient pieces until they are
applied), and the replay calls' outputs, in buffers each slice reuses from call to call
(:meth:`ReplayPrograms.run`). Replay calls are cut per slice, so the calls of
slice ``i`` are the same at every later phase and in every window: with row chunks every
call of a slice has the same shapes, and the replay compiles one program per slice
(:class:`Chunk`). Each compiled program keeps several MiB of host memory, and a window
of K=3 on a 20M LM compiled 15 of them when calls were cut per phase.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import WindowAborted
from ..hostarray import index_key, normalize_index
from . import scalars
from .capture import Outbox
from .buffers import MOVED, BlockKey, HostBuffers, host_array, replicated_value, store_piece, trim_host_memory, unlead
from .interp import InterpretError, interpret
from .plan import CapturePlan, LeafLayout
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
    the slice's last call computes its last rows again (from values already advanced) and
    the result is dropped. That is exact only for row-separable updates, which is what a
    chunked plan is; whole-leaf plans compute and keep whole leaves.
    """

    rows: Piece
    keep: Piece


GradParts = dict[tuple[int, BlockKey], list[tuple[Piece, np.ndarray]]]

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
        self.replayed_bytes = 0  # bytes of params + owned state advanced by replay
        self.apply_seconds = 0.0  # time in replay calls (gather, run, write back), copy-in excluded

    @property
    def complete(self) -> bool:
        return self.next_phase == self.plan.k

    def receive(self, outbox: Outbox) -> None:
        plan, phase = self.plan, outbox.ticket.phase
        if phase != self.next_phase:
            raise WindowAborted(f"phase {phase} arrived where {self.next_phase} was due. {UNREPORTED_STEP}")
        last = phase == plan.k - 1
        # The outbox is the window's now: each captured array is dropped as soon as it is
        # used (the slice once copied in, gradient pieces once applied), not at the end of
        # the phase, so that the host never holds a slice twice while the replay runs.
        captured, outbox.state = outbox.state, []
        targets = [(blocks, piece) for p in plan.slicing.slices[phase] for blocks, piece in (
            (self.buffers.params[p.leaf], p),
            *((self.buffers.state[j], plan.state_piece(j, p)) for j in plan.analysis.owned_state(p.leaf)))]
        for i, (blocks, piece) in enumerate(targets):
            store_piece(blocks, captured[i], piece, adopt=last)
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
            for batch in self.programs.slice_batches(i):
                self._replay_batch(batch, parts, injected)
            del parts
            first = stop
        self.apply_seconds += time.perf_counter() - start

    def _grad_parts(self, pieces: tuple[Piece, ...], grads: list[jax.Array]) -> GradParts:
        """The captured gradient of each piece, by (leaf, host block): views, not copies."""
        parts: GradParts = {}
        for piece, g in zip(pieces, grads):
            layout = self.plan.params[piece.leaf]
            g = unlead(g, len(layout.shape))
            want = (piece.stop - piece.start,) + tuple(layout.block_shape[1:]) if layout.shape else ()
            for shard in g.addressable_shards:
                if shard.replica_id == 0:
                    if tuple(shard.data.shape) != want:
                        raise WindowAborted(f"the gradient of params leaf {piece.leaf} arrived in blocks of "
                                            f"shape {tuple(shard.data.shape)} where {want} was planned. {MOVED}")
                    key = index_key(layout.block_of(normalize_index(shard.index, g.shape), piece))
                    parts.setdefault((piece.leaf, key), []).append((piece, np.asarray(shard.data)))
        return parts

    def _replay_batch(self, batch: tuple[Chunk, ...], grad_parts: GradParts, injected: list[np.ndarray]) -> None:
        """One replay call over ``batch``, in place in the host blocks: its inputs are views
        of them (stacked only when a leaf has several blocks), its outputs land in reused
        output buffers and are copied back, so the replay holds those buffers besides the
        copy and no output memory per call."""
        plan = self.plan
        by_leaf = {chunk.rows.leaf: chunk for chunk in batch}
        owned = {j: by_leaf[owner] for j, owner in enumerate(plan.analysis.state_owner) if owner in by_leaf}
        params_in = {k: self._gather(plan.params[k], self.buffers.params[k], c.rows) for k, c in by_leaf.items()}
        grads_in = {k: self._gather(plan.params[k], None, c.rows, grad_parts) for k, c in by_leaf.items()}
        state_in = {j: self._gather(plan.state[j], self.buffers.state[j], plan.state_piece(j, c.rows))
                    for j, c in owned.items()}
        args = self.programs.arguments(params_in, state_in, grads_in, self.shared)
        n = len(plan.params)
        del params_in, state_in, grads_in
        outs = self.programs.run(args, injected, [*by_leaf, *(n + j for j in owned)])
        del args
        for k, c in by_leaf.items():
            self._scatter(plan.params[k], self.buffers.params[k], c.rows, c.keep, outs[k])
            self.replayed_bytes += self.programs.bytes_of(c.keep)
        for j, c in owned.items():
            self._scatter(plan.state[j], self.buffers.state[j], plan.state_piece(j, c.rows),
                          plan.state_piece(j, c.keep), outs[n + j])
        self.shared_after_replay = [np.asarray(outs[n + j]) for j in plan.analysis.shared_state]

    def _gather(self, layout: LeafLayout, blocks: Any, rows: Piece, grad_parts: GradParts | None = None) -> np.ndarray:
        """The replay input of one leaf: ``rows`` of each of its blocks (of the host copy,
        or of the captured gradient with ``grad_parts``), stacked along axis 0; a view when
        the leaf has one block. Whole-leaf plans take the leaf in its global shape."""
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
        if not self.plan.chunked:
            out = np.empty(layout.shape, layout.dtype)
            for index, key in zip(layout.blocks, keys):
                out[index] = part(key)
            return out
        return np.concatenate([part(key) for key in keys], axis=0)

    def _scatter(self, layout: LeafLayout, blocks: Any, rows: Piece, keep: Piece, value: Any) -> None:
        """Write the ``keep`` rows of a call's output (computed over ``rows``) back into the
        host blocks."""
        value = np.asarray(value)
        keys = [index_key(b) for b in layout.blocks]
        if not self.plan.chunked:
            if len(keys) == 1:
                np.copyto(blocks[keys[0]], value.reshape(blocks[keys[0]].shape))
                return
            for index, key in zip(layout.blocks, keys):
                np.copyto(blocks[key], value[index])
            return
        if keep.stop == keep.start:
            return
        if not layout.shape:
            np.copyto(blocks[keys[0]], value)
            return
        n, lo, hi = rows.stop - rows.start, keep.start - rows.start, keep.stop - rows.start
        for i, key in enumerate(keys):
            np.copyto(blocks[key][keep.start:keep.stop], value[i * n + lo:i * n + hi])

    def result(self) -> tuple[Any, Any, Any]:
        """(params, opt_state, extras) of version V as trees of :class:`HostArray`."""
        if not self.complete:
            raise WindowAborted(f"window for step {self.version} is incomplete")
        plan = self.plan
        return (jax.tree.unflatten(plan.params_def, [host_array(b) for b in self.buffers.params]),
                jax.tree.unflatten(plan.state_def, [host_array(b) for b in self.buffers.state]),
                jax.tree.unflatten(plan.extras_def, [host_array(b) for b in self.buffers.extras]))


def _lockstep(pieces: tuple[Piece, ...], row_bytes, limit: int) -> list[tuple[Chunk, ...]]:
    """Row chunks of ``pieces`` in calls of about ``limit`` bytes, every call taking the
    same number of rows of every piece (see :class:`Chunk`): one program for all calls."""
    total = sum((p.stop - p.start) * row_bytes(p.leaf) for p in pieces)
    calls = max(1, -(-total // max(limit, 1)))
    out = []
    for b in range(calls):
        batch = []
        for p in pieces:
            n = p.stop - p.start
            c = -(-n // calls)
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
        self.cpu = jax.local_devices(backend="cpu")[0]  # this process's (multi-process CPU jobs)
        n, m = len(plan.params), len(plan.state)
        flat = self._flat = flat_update_fn(plan.update, plan.params_def, plan.state_def)
        tokens = input_tokens(n, m)

        signature, read = plan.analysis.cut_signature, plan.analysis.cut_read

        def run(args, injected, reuse):
            del reuse  # donated: XLA writes the outputs into these buffers (see :meth:`run`)
            outs, _ = interpret(flat, "inject", args, tokens, injected, signature, read)
            # Returning the injected scalars gives each one the extra use it has on the
            # device (where it is also shipped out): XLA:CPU rewrites a division by a
            # broadcast scalar differently when the scalar has a single use.
            return [o.value for o in outs], list(injected)

        # keep_unused: jit drops arguments the program does not read, and a dropped
        # argument is not donated (the outputs would go to fresh memory again).
        self._run = jax.jit(run, donate_argnums=2, keep_unused=True)
        self._outputs: dict[tuple, list[jax.Array]] = {}  # output shapes -> buffers of that shape
        self._dummy_state: list[np.ndarray] | None = None
        self._stand_ins: tuple[list[jax.Array], list[jax.Array]] | None = None
        self.batch_bytes = int(min(max(plan.state_bytes // 20, 4 << 20), 64 << 20))
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
            return _lockstep(pieces, self.unit_row_bytes, self.batch_bytes)
        return _grouped(pieces, self._piece_bytes, self.batch_bytes)

    def slice_batches(self, i: int) -> list[tuple[Chunk, ...]]:
        """The replay calls that advance slice ``i`` (of a window that is not its last
        slice) by one step: its pieces in calls of about :attr:`batch_bytes` (params +
        owned state), so that the replay's scratch stays bounded whatever K and the
        state's size. Phase ``j`` runs the calls of slices 0..j."""
        return self._batches[i]

    def scratch_bytes(self) -> int:
        """The most host memory a phase holds besides the host copy: its outbox (the
        captured slice until it is copied in, the gradient pieces of slices 0..j until
        they are applied), one replay call's inputs (when stacked or converted) and
        gradients, and the calls' output buffers (kept per slice when chunked, see
        :meth:`run`; else one call's)."""
        plan = self.plan

        def rows(batch) -> int:
            return sum(self.bytes_of(c.rows) for c in batch)

        most_call = max((rows(batch) + sum(self._grad_bytes(c.rows) for c in batch)
                         for batches in self._batches for batch in batches), default=0)
        outputs: dict[tuple, int] = {}  # as run() keeps them: one set per distinct shapes
        for batch in (batch for batches in self._batches for batch in batches):
            shapes = _shapes(self.outputs_of(batch))
            outputs[shapes] = max(outputs.get(shapes, 0), rows(batch))
        kept_outputs = sum(outputs.values()) if plan.chunked else max(outputs.values(), default=0)
        most_outbox = max((sum(self.bytes_of(p) for p in plan.slicing.slices[j])
                           + sum(self._grad_bytes(p) for p in plan.slicing.pieces_upto(j))
                           for j in range(plan.k - 1)), default=0)
        return most_outbox + most_call + kept_outputs

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
        for i, args, injected, reuse in self._calls():
            with blame(self._flat, args, f"on slice {i} of a window",
                       f"rehearsing the host replay of slice {i} of a window"):
                outs, _ = jax.eval_shape(self._run, args, injected, reuse)
            for k, x in enumerate(args[:len(plan.params)]):
                if tuple(outs[k].shape) != x.shape:
                    raise InterpretError(f"the replay of a slice returns params of shape "
                                         f"{tuple(outs[k].shape)} for an input of shape {x.shape}")

    def compile(self) -> None:
        """Compile every replay program before the first window (``compile_ahead``).

        Why: compiled on the replay thread at the first window, they add XLA's working
        memory to the window's own, and glibc keeps most of it after the compile (a probe
        of the 20M LM, K=3: the first window's RSS ~0.6x the state above the later ones';
        the benchmark's peak RSS moved by less than its run-to-run noise). Compiled here,
        :meth:`OverlapEngine.compile_replay` returns that memory before any window."""
        with jax.default_device(self.cpu):
            for _, args, injected, reuse in self._calls():
                self._run.lower(args, injected, reuse).compile()

    def _calls(self):
        """``(slice, args, injected, reuse)`` of one replay call per distinct program, as
        abstract arrays: the arguments of the jitted program (see :meth:`run`)."""
        plan = self.plan
        injected = [jax.ShapeDtypeStruct((), np.dtype(dtype)) for _, dtype in plan.analysis.shipped_signature]
        shared = [jax.ShapeDtypeStruct(plan.state[j].shape, plan.state[j].dtype) for j in plan.analysis.shared_state]
        for i, batch in ((i, batch) for i in range(plan.k - 1) for batch in self.slice_batches(i)):
            outputs = self.outputs_of(batch)
            leaves = [c.rows.leaf for c in batch]
            params_in = dict(zip(leaves, outputs))
            owned = [j for j, o in enumerate(plan.analysis.state_owner) if o in leaves]
            state_in = dict(zip(owned, outputs[len(leaves):]))
            yield i, self.arguments(params_in, state_in, dict(params_in), shared), injected, outputs

    def outputs_of(self, batch: tuple[Chunk, ...]) -> list[jax.ShapeDtypeStruct]:
        """The outputs a call over ``batch`` writes into donated buffers: its params leaves,
        then the state leaves they own, shaped as their inputs."""
        plan = self.plan
        by_leaf = {c.rows.leaf: c.rows for c in batch}
        return [*(self.gathered(plan.params[k], rows) for k, rows in by_leaf.items()),
                *(self.gathered(plan.state[j], plan.state_piece(j, by_leaf[o]))
                  for j, o in enumerate(plan.analysis.state_owner) if o in by_leaf)]

    def gathered(self, layout: LeafLayout, rows: Piece) -> jax.ShapeDtypeStruct:
        """Shape and dtype of :meth:`WindowReplay._gather` of ``rows`` of this leaf."""
        if not layout.shape:
            shape: tuple[int, ...] = ()
        elif not self.plan.chunked:
            shape = layout.block_shape if len(layout.blocks) == 1 else layout.shape
        else:
            shape = ((rows.stop - rows.start) * len(layout.blocks),) + tuple(layout.block_shape[1:])
        return jax.ShapeDtypeStruct(shape, layout.dtype)

    def run(self, args: list[np.ndarray], injected: list[np.ndarray], advanced: list[int]) -> list[jax.Array]:
        """One replay call: the outputs at ``advanced`` (the leaves it advances, shaped as
        their inputs) are written into buffers the call donates, those of the last call
        whose outputs had the same shapes.

        Why: XLA:CPU puts every output of a call in fresh memory, and on this hardware
        faulting in fresh pages cost several times the update itself (a 16 MB chunk, alone:
        40 ms for the update into fresh outputs and the copy back, against 6 ms for the
        update into memory already touched and 3 ms for a memcpy). A chunked plan's calls
        of a slice all have the same shapes, and the slices of a model of equal layers
        often too: one set of buffers serves them, in every later call and window. They
        stay allocated as long as the plan (counted in :meth:`scratch_bytes`). Whole-leaf
        calls differ in shape from group to group: theirs are made per call. The program
        itself is the one without donation (the buffers are not read), so the values are
        those of the device's update, bit for bit.
        """
        shapes = _shapes(args[j] for j in advanced)
        with jax.default_device(self.cpu):
            reuse = self._outputs.pop(shapes, None) if self.plan.chunked else None
            if reuse is None:
                # Made as the stand-ins are (uncommitted): one program for the first call and
                # the later ones, whatever mesh the loop has set.
                reuse = [jnp.zeros(np.shape(args[j]), args[j].dtype) for j in advanced]
            outs = self._run(args, injected, reuse)[0]
        if self.plan.chunked:
            self._outputs[shapes] = [outs[j] for j in advanced]
        return outs


def _shapes(arrays) -> tuple:
    return tuple((tuple(np.shape(x)), np.dtype(x.dtype)) for x in arrays)
