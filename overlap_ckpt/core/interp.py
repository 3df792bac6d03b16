"""A jaxpr interpreter that tracks which train-state leaves every value depends on.

Why it exists: host replay advances *slices* of the state with the user's own optax
transformation. That is only exact if (a) each output leaf depends on its own leaf's
data and on shared scalars, and (b) every value that summarises data across leaves or
within a chunked leaf (a global norm, a finite flag, a per-leaf trust ratio) is taken
from the device instead of being recomputed from the partial data the host holds.

The interpreter evaluates the traced update function equation by equation, binding the
original primitives (so the program XLA sees keeps the user's structure), and carries
for every value a set of *tokens* naming the input leaves it was computed from. A
scalar produced by a non-elementwise primitive (a reduction) from leaf data is a
**cut**: in ``record`` mode (on the device) its value is appended to ``cuts`` so the step
can ship it; in ``inject`` mode (host replay) the recorded device value replaces it. Cuts
are found in program order, so device and host, tracing the same Python code on trees
of the same structure, see the same sequence.

Only the cuts that something other than scalar arithmetic on cuts reads (a leaf's update,
an output, a branch or loop) are *read* (:attr:`Interpreter.read`) and need shipping: the
host takes those from the device and computes the rest from whatever it holds. Why not
ship every cut: a global norm over n leaves is a chain of n scalar additions; shipping each
partial sum gives each a second use, into which XLA (CPU and GPU) fuses the whole chain
again, n^2 additions that took a 201-leaf step from 5 s to 17 s to compile on the CPU.

A read cut may reach what reads it through a *barrier* (``barrier``), on both sides alike:
the device goes on with an opaque copy of the value it records, the host with an opaque
choice between the device's value and the one it computed itself, so that the arithmetic
feeding the cut stays in the host's program as in the device's (see
:func:`overlap_ckpt.core.capture.cut_barrier`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jcore
import numpy as np
from jax import lax

from . import rules

Tokens = frozenset


class InterpretError(ValueError):
    """The update program does something that cannot be replayed on slices."""


@dataclasses.dataclass
class Labelled:
    """A value (concrete or traced) with the input leaves it depends on.

    ``nonelementwise`` is set when the value went through a non-elementwise operation
    on leaf data that was not cut: such a value is only right when computed from the
    whole leaf, so its leaf may not be split into row chunks.
    """

    value: Any
    tokens: Tokens = Tokens()
    nonelementwise: bool = False
    from_cut: bool = False  # computed from a cut scalar (see ``_eval_eqn``)
    # Input leaves whose element i flows into element i of this value (not through a
    # broadcast scalar): what a co-read (see ``co_reads``) is made of.
    leaf_tokens: Tokens = Tokens()
    cut: int | None = None  # the position of the cut this value is, if it is one


class Interpreter:
    """Evaluates a jaxpr on labelled values, recording or injecting cut scalars.

    mode ``"record"``: cuts are appended to :attr:`cuts` (device step).
    mode ``"inject"``: the cuts that ``read`` marks are replaced by ``injected``, in order
    (host replay); the others keep the value computed here. Without ``read``, every cut is.

    ``barrier``: what the program goes on with at a read cut (see the module docstring).
    Record mode: ``barrier(value)`` at the cuts ``read`` marks (the plan's, known before the
    step); inject mode: ``barrier(injected, computed)`` at every injected cut.
    """

    def __init__(self, mode: str, injected: Sequence[Any] = (), expected: Sequence[tuple[str, str]] | None = None,
                 read: Sequence[bool] | None = None, barrier: Callable[..., Any] | None = None):
        if mode not in ("record", "inject"):
            raise ValueError(f"unknown interpreter mode {mode!r}")
        self.mode = mode
        self.cuts: list[Any] = []
        # (primitive, dtype) of every cut in order: the device's sequence is kept in the
        # plan and the host's must match it, or the injected values would land elsewhere.
        self.signature: list[tuple[str, str]] = []
        self.expected = None if expected is None else list(expected)
        self.injected = list(injected)
        self._next_injected = 0
        self._read_mask = None if read is None else list(read)
        self._barrier = barrier
        # Positions of the cuts read by something other than a cut (see the module docstring).
        self.read: set[int] = set()
        # Token sets of leaves read together, element by element (``p0 - p``): a state
        # leaf read this way with one parameter leaf belongs to its slice even when the
        # update never writes it (a frozen copy of the initial params).
        self.co_reads: list[Tokens] = []
        # Traced scalars that array operations read, with how many do, and (inject mode) the
        # branch outputs that carry injected values: see :meth:`kept_apart`.
        self._broadcast_reads: dict[int, list] = {}
        self._branch_slots: list[Any] = []
        # Inject mode: cut position -> the value a branch's slot output carries there (a
        # cond's slots are cuts of the interpreter that meets the cond): see ``used_cuts``.
        self._slot_outputs: dict[int, Any] = {}
        self._used: list[tuple[int, Any]] = []  # inject mode: (position, injected value) of each injected cut
        # Whether the program branches or loops (a cond, a while, a scan): see ``replay``.
        self.branches = False

    # -- cuts ---------------------------------------------------------------------------
    def _cut(self, value: Any, where: str, primitive: str, *, read: bool = False) -> Labelled:
        position = len(self.signature)
        self.signature.append((primitive, str(np.dtype(value.dtype))))
        if read:
            self.read.add(position)
        # A cond's slots (primitive "cond") carry what its branches cut: their own barriers.
        barrier = self._barrier if primitive != "cond" else None
        if self.mode == "record":
            self.cuts.append(value)
            if barrier is not None and self._marked(position):
                return Labelled(barrier(value), from_cut=True, cut=position)
            return Labelled(value, from_cut=True, cut=position)
        if self.expected is not None and (position >= len(self.expected)
                                          or self.expected[position] != self.signature[-1]):
            want = self.expected[position] if position < len(self.expected) else "nothing"
            raise InterpretError(
                f"global scalar #{position} is {self.signature[-1]} in the host replay but "
                f"{want} on the device (at {where}): the optimizer runs different code for "
                "the host's leaf shapes, so this slicing cannot be replayed exactly.")
        if self._read_mask is not None and not self._marked(position):
            return Labelled(value, from_cut=True, cut=position)
        if self._next_injected >= len(self.injected):
            raise InterpretError(
                f"host replay found more global scalars than the device recorded (at "
                f"{where}); the optimizer's program depends on leaf shapes, so it cannot be "
                "replayed on chunks. Use whole-leaf slicing (chunk_leaves=False).")
        injected = self.injected[self._next_injected]
        self._next_injected += 1
        self._used.append((position, injected))
        if np.shape(injected) != np.shape(value) or np.dtype(injected.dtype) != np.dtype(value.dtype):
            raise InterpretError(
                f"global scalar #{self._next_injected - 1} at {where} is "
                f"{np.shape(value)}/{value.dtype} on the host but the device recorded "
                f"{np.shape(injected)}/{injected.dtype}.")
        if barrier is not None:
            injected = barrier(injected, value)
        return Labelled(injected, from_cut=True, cut=position)

    def _marked(self, position: int) -> bool:
        """Whether ``read`` (as given) marks the cut at ``position``."""
        mask = self._read_mask
        return mask is not None and position < len(mask) and mask[position]

    def read_cuts(self) -> list[Any]:
        """The recorded cuts that are read (what the device ships), in order."""
        return [c for i, c in enumerate(self.cuts) if i in self.read]

    def _mark_read(self, ins: Sequence[Labelled]) -> None:
        self.read.update(i.cut for i in ins if i.cut is not None)

    def finish(self) -> None:
        """Check that every injected scalar was consumed (same program on both sides)."""
        if self.mode == "inject" and self._next_injected != len(self.injected):
            raise InterpretError(
                f"the device recorded {len(self.injected)} global scalars but host replay "
                f"used {self._next_injected}; the optimizer's program differs between the "
                "full tree and a slice, so slice replay is not exact.")

    # -- evaluation ---------------------------------------------------------------------
    def eval_closed(self, closed: jcore.ClosedJaxpr, args: Sequence[Labelled]) -> list[Labelled]:
        consts = [Labelled(c) for c in closed.consts]
        return self.eval_jaxpr(closed.jaxpr, consts, args)

    def eval_jaxpr(self, jaxpr: jcore.Jaxpr, consts: Sequence[Labelled],
                   args: Sequence[Labelled]) -> list[Labelled]:
        env: dict[Any, Labelled] = {}

        def read(atom) -> Labelled:
            if isinstance(atom, jcore.Literal):
                return Labelled(atom.val)
            return env[atom]

        for var, val in zip(jaxpr.constvars, consts):
            env[var] = val
        if len(args) != len(jaxpr.invars):
            raise InterpretError(f"expected {len(jaxpr.invars)} inputs, got {len(args)}")
        for var, val in zip(jaxpr.invars, args):
            env[var] = val
        for eqn in jaxpr.eqns:
            ins = [read(a) for a in eqn.invars]
            outs = self._eval_eqn(eqn, ins)
            for var, out in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = out
        return [read(a) for a in jaxpr.outvars]

    def _eval_eqn(self, eqn, ins: list[Labelled]) -> list[Labelled]:
        name = eqn.primitive.name
        if name in rules.CALL_JAXPR_PARAM and rules.CALL_JAXPR_PARAM[name] in eqn.params:
            sub = eqn.params[rules.CALL_JAXPR_PARAM[name]]
            if isinstance(sub, jcore.ClosedJaxpr):
                return self.eval_closed(sub, ins)
            return self.eval_jaxpr(sub, [], ins)
        if name == "cond":
            return self._eval_cond(eqn, ins)
        tokens = Tokens().union(*(i.tokens for i in ins))
        from_cut = any(i.from_cut for i in ins)
        nonel = any(i.nonelementwise for i in ins)
        values = [i.value for i in ins]
        out = eqn.primitive.bind(*values, **eqn.params)
        outs = list(out) if eqn.primitive.multiple_results else [out]
        if any(True for _ in jcore.jaxprs_in_params(eqn.params)):
            # while/scan and other loops: opaque. Every output may depend on every input,
            # and nothing inside is cut, so leaf data inside forbids chunking.
            self.branches = True
            self._mark_read(ins)
            return [Labelled(o, tokens, bool(tokens) or from_cut or nonel, from_cut) for o in outs]
        shapes = [tuple(np.shape(o)) for o in outs]
        if any(shapes):
            self._note_broadcast_scalars(ins)
        elementwise = rules.is_elementwise(name, [tuple(np.shape(i.value)) for i in ins])
        if rules.is_global_scalar(shapes, bool(tokens), elementwise, from_cut):
            where = f"{name} at {eqn.source_info.name_stack}" if hasattr(eqn, "source_info") else name
            return [self._cut(o, where, name) for o in outs]
        self._mark_read(ins)
        if elementwise:
            self._note_co_read(ins)
            escaped = rules.escapes_as_size_one(shapes, from_cut)
            leaf_tokens = Tokens() if name == "broadcast_in_dim" else Tokens().union(*(i.leaf_tokens for i in ins))
            return [Labelled(o, tokens, nonel or escaped, from_cut, leaf_tokens) for o in outs]
        return [Labelled(o, tokens, bool(tokens) or from_cut or nonel, from_cut) for o in outs]

    def _note_broadcast_scalars(self, ins: list[Labelled]) -> None:
        for i in ins:
            if np.ndim(i.value) == 0 and isinstance(i.value, jax.core.Tracer):
                self._broadcast_reads.setdefault(id(i.value), [i.value, 0])[1] += 1

    def kept_apart(self) -> list[Any]:
        """Values the host replay returns besides the leaves it keeps (inject mode), so that
        XLA:CPU compiles each one as it does on the device, where it has the same uses.

        Why: XLA:CPU compiles a scalar that one operation reads into that operation's
        vectorised loop, and one that several read on its own, and the two round
        differently (a ``pow`` in a bias correction differs in the last bit). The same holds
        for a branch: the device ships the scalars a branch cuts as outputs of the branch,
        and a branch that does not output them compiles otherwise (novograd's moments,
        whose per-leaf norms are cut inside a ``lax.cond``, differed in the last bit).
        Returned here:

        * the traced scalars that more than one array operation reads (a bias correction,
          a learning rate, a clipping scale). The replay of a slice computes fewer leaves
          than the device, so a scalar that every leaf reads on the device may have one
          reader there. One read by a single operation on the whole tree is left alone:
          the device fuses it too;
        * every branch's cut slots, which carry the injected values where the device's
          carry the values it shipped."""
        return [*(value for value, reads in self._broadcast_reads.values() if reads > 1), *self._branch_slots]

    def used_cuts(self) -> list[Any]:
        """Inject mode: the value at each injected cut, in order, before any barrier (what a
        branch outputs in its slots, where the device's branch outputs the cuts it
        recorded). A cut that is a slot of a cond met here is that cond's slot output, not
        the injected value it was given: otherwise XLA drops the inner cond's slot outputs
        and compiles it differently from the device's."""
        return [self._slot_outputs.get(position, value) for position, value in self._used]

    def _note_co_read(self, ins: list[Labelled]) -> None:
        leafwise = [i.leaf_tokens for i in ins if i.leaf_tokens]
        if len(leafwise) > 1:
            self.co_reads.append(Tokens().union(*leafwise))

    def _eval_cond(self, eqn, ins: list[Labelled]) -> list[Labelled]:
        self.branches = True
        self._mark_read(ins)
        index, ops = ins[0], ins[1:]
        branches: Sequence[jcore.ClosedJaxpr] = eqn.params["branches"]

        def branch_interpreter(b: int, values: Sequence[Any], inner: "Interpreter") -> tuple["Interpreter", list]:
            outs = inner.eval_closed(branches[b], [
                Labelled(v, o.tokens, o.nonelementwise, o.from_cut, o.leaf_tokens) for v, o in zip(values, ops)])
            inner._mark_read(outs)  # what the branch returns, the program after the cond may read
            inner.finish()
            return inner, outs

        # Dry-run every branch abstractly to learn its cuts and which of them it reads, so
        # that all branches return the same fixed set of slots, one per read cut (a branch
        # fills its own, zeros elsewhere), as the whole program ships its read cuts only.
        probes, reads = [], []
        for b in range(len(branches)):
            probe = Interpreter("record")
            jax.eval_shape(lambda *v, b=b, p=probe: [o.value for o in branch_interpreter(b, v, p)[1]],
                           *[o.value for o in ops])
            reads.append([n in probe.read for n in range(len(probe.cuts))])
            probes.append([jax.ShapeDtypeStruct(np.shape(c), c.dtype) for c in probe.read_cuts()])
        offsets = np.cumsum([0] + [len(p) for p in probes])
        injected_slots: list[Any] = []
        positions: list[int] = []
        if self.mode == "inject":
            positions = [len(self.signature) + n for n in range(offsets[-1])]
            injected_slots = [self._cut(jax.numpy.zeros(s.shape, s.dtype), "cond", "cond", read=True).value
                              for p in probes for s in p]

        def interpreter(b: int) -> "Interpreter":
            injected = injected_slots[offsets[b]:offsets[b + 1]] if self.mode == "inject" else ()
            return Interpreter(self.mode, injected, read=reads[b], barrier=self._barrier)

        labels: list[list[tuple[Tokens, bool, bool]]] = [[] for _ in branches]

        def make_branch(b: int) -> Callable:
            def run(*values):
                inner, outs = branch_interpreter(b, values, interpreter(b))
                labels[b][:] = [(o.tokens, o.nonelementwise, o.from_cut) for o in outs]
                slots = [jax.numpy.zeros(s.shape, s.dtype) for p in probes for s in p]
                slots[offsets[b]:offsets[b + 1]] = inner.read_cuts() if self.mode == "record" else inner.used_cuts()
                return [o.value for o in outs], slots
            return run

        out_values, slot_values = lax.switch(
            index.value, [make_branch(b) for b in range(len(branches))], *[o.value for o in ops])
        if self.mode == "record":
            for value in slot_values:
                self._cut(value, "cond", "cond", read=True)
        else:
            self._branch_slots.extend(slot_values)
            self._slot_outputs.update(zip(positions, slot_values))
        result = []
        for k, value in enumerate(out_values):
            tokens = index.tokens.union(*(labels[b][k][0] for b in range(len(branches))))
            nonel = index.nonelementwise or any(labels[b][k][1] for b in range(len(branches)))
            from_cut = index.from_cut or any(labels[b][k][2] for b in range(len(branches)))
            result.append(Labelled(value, tokens, nonel, from_cut))
        return result


def interpret(fn: Callable, mode: str, args: Sequence[Any], tokens: Sequence[Tokens],
              injected: Sequence[Any] = (), expected: Sequence[tuple[str, str]] | None = None,
              read: Sequence[bool] | None = None, barrier: Callable[..., Any] | None = None,
              replayed_outputs: int | None = None) -> tuple[list[Labelled], Interpreter]:
    """Trace ``fn(*flat_args)`` and evaluate it with labelled inputs.

    ``args`` is the flat list of input arrays (concrete or tracers), ``tokens`` their
    labels. Returns the labelled flat outputs and the interpreter (whose ``cuts`` holds
    the recorded global scalars in ``record`` mode, ``read`` which of them are read).
    ``read``: which cuts are read, as a record found them (inject mode: which ``injected``
    holds). ``barrier``: see :class:`Interpreter`. ``replayed_outputs``: how many leading
    outputs the host replays (default all); a global scalar that only a later output is
    (the optax updates a door returns) is not read by the replay.
    """
    closed = jax.make_jaxpr(fn)(*args)
    interp = Interpreter(mode, injected, expected, read, barrier)
    outs = interp.eval_closed(closed, [Labelled(a, t, leaf_tokens=t if np.ndim(a) > 0 else Tokens()) for a, t in zip(args, tokens)])
    interp._mark_read(outs[:replayed_outputs])
    interp.finish()
    return outs, interp
