"""A user's own step, checked for a target in one call: ``CheckpointManager.aot_report`` and
``overlap-ckpt aot --step``.

Why: a user with a Flax loop asks, on a CPU machine, "does my step's checkpoint window
overlap on an H100 / a TPU v5e, and what will it cost". The pieces were all there
(:func:`~overlap_ckpt.aot.compile_window` and the ``overlap-ckpt aot`` report), but the user
had to rebuild the step's arguments on the target's devices by hand. Here the arguments of
one call, as given to ``compile_ahead``, are moved onto the target
(:mod:`overlap_ckpt.aot.placement`), the plain step and every window phase of the K the
manager would use are compiled as ``compile_ahead`` compiles them, and the result is what
the command reports for its LMs: where each copy starts, which are serialized, the device
memory beyond the plain step, the check's findings (collected, not raised) and the
predicted stall beside Orbax's async save.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax

from ..doors.registry import door_for
from . import predict
from .markdown import analysis_note, markdown, run_notes
from .placement import Placement
from .programs import compile_program
from .targets import Target, get_target
from .user_step import lower_in_window, plan_state
from .window import AotCheckError, WindowReport, compiled_phases


class StepError(TypeError):
    """What was given is not a step and its arguments this report can compile."""


class ScheduleHints(Protocol):
    """The GPU copy schedule hint (:class:`overlap_ckpt.manager.copy_schedule.CopyScheduleHints`)."""

    def compiler_options(self) -> dict[str, str]: ...

    def prepare(self, lowered: jax.stages.Lowered) -> object: ...


@dataclasses.dataclass(frozen=True)
class UserStep:
    """A jitted step and the arguments of one call (as given to ``compile_ahead``), and the
    door's arguments (as given to ``prepare``): ``model`` for an ``overlap_ckpt.nnx.Optimizer``
    with ``nnx.jit``, ``graphdef`` for the functional NNX style."""

    step: Any
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    model: Any = None
    graphdef: Any = None

    @classmethod
    def of(cls, made: Any) -> "UserStep":
        """A :class:`UserStep`, or a tuple ``(step, args)`` / ``(step, args, kwargs)``."""
        if isinstance(made, cls):
            return made
        if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[1], (tuple, list)):
            return cls(made[0], tuple(made[1]), dict(made[2]) if len(made) == 3 else {})
        raise StepError(f"expected overlap_ckpt.aot.UserStep(step, args, kwargs, model=, graphdef=) or a tuple "
                        f"(step, args[, kwargs]), got {type(made).__name__}")


@dataclasses.dataclass(frozen=True)
class CopyFact:
    """One host copy of one window phase. ``after_start``: the share of the step's matmul flops
    scheduled after it starts (1.0: at the top); ``during``: while it transfers (None for both
    where the program has no matmuls)."""

    k: int
    phase: int
    leaf: str
    kind: str
    nbytes: int
    after_start: float | None
    during: float | None
    serialized: bool


@dataclasses.dataclass(frozen=True)
class PhaseFact:
    """One window phase: its host copies, how many serialized, and its device memory."""

    k: int
    phase: int
    host_copies: int
    serialized: int
    outbox_bytes: int
    extra_device_bytes: int  # beyond the plain step's (argument + output - alias + temp)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """The plain step and the window phases of a user's step, compiled for a target."""

    name: str
    target: Target
    arguments: tuple[tuple, dict]  # the call's arguments, on the target's devices
    windows: dict[int, WindowReport]  # K -> its compiled window
    labels: dict[int, str]  # K -> why it was compiled
    cost: predict.StepCost
    intervals: tuple[int, ...]
    k: int | None  # the K the manager would use (None: ks given, or "auto" without an interval)
    auto: predict.AutoChoice | None  # what window="auto" picks (None: not asked)
    violations: dict[int, tuple[str, ...]]  # K -> what the check finds, one sentence each
    notes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether every compiled window passes the check."""
        return not any(self.violations.values())

    def check(self) -> None:
        """Raise :class:`~overlap_ckpt.aot.AotCheckError` listing every violation."""
        found = [f"K={k}: {v}" for k, vs in sorted(self.violations.items()) for v in vs]
        if found:
            raise AotCheckError(f"window programs of {self.name} for {self.target.name} fail the check:\n  - "
                                + "\n  - ".join(found))

    def copies(self) -> list[CopyFact]:
        """Every host copy of every phase, in the order each phase starts them."""
        return [CopyFact(k, j, c.leaf, c.kind, c.nbytes, p.after_start(c) if p.matmul_flops else None,
                         p.between(c) if p.matmul_flops else None, not c.overlapped)
                for k, w in sorted(self.windows.items()) for j, p in enumerate(w.phases)
                for c in sorted(p.host_copies, key=lambda c: c.flops_before)]

    def phases(self) -> list[PhaseFact]:
        return [PhaseFact(k, j, len(p.host_copies), sum(not c.overlapped for c in p.host_copies),
                          p.memory.host_output, p.memory.peak - w.plain.memory.peak)
                for k, w in sorted(self.windows.items()) for j, p in enumerate(w.phases)]

    def stall_s(self, k: int) -> float:
        """Predicted stall per checkpoint with windows of ``k`` steps, the copies as scheduled."""
        if k not in self.windows:
            raise KeyError(f"K={k} was not compiled (compiled: {sorted(self.windows)}); pass ks=[{k}]")
        return predict.window_stall_s(self.windows[k], self.cost)

    @property
    def orbax_stall_s(self) -> float:
        """Predicted stall per checkpoint of Orbax's async save (a blocking copy of the state)."""
        return predict.orbax_async_stall_s(next(iter(self.windows.values())))

    def markdown(self) -> str:
        """The ``overlap-ckpt aot`` report of this step."""
        return markdown(f"your step `{self.name}`", self.windows, self.labels, self.cost, list(self.intervals),
                        list(self.notes))


def report_step(user: UserStep, target: Target | str, *, ks: Sequence[int] | None = None,
                window: int | str = "auto", interval: int | None = None, intervals: Sequence[int] = (10, 50),
                hints: ScheduleHints | None = None, mesh_shape: Mapping[str, int] | None = None,
                log: Callable[[str], None] = lambda line: None) -> StepReport:
    """Compile ``user``'s plain step and window phases for ``target`` (a name such as
    ``"h100"`` or ``"v5e:2x2"``, or a :class:`Target`), check and cost them.

    Which K: ``ks`` exactly, else ``window`` as the manager takes it: a number, or ``"auto"``:
    K=1, then what ``window="auto"`` picks at ``interval`` (the manager's checkpoint interval)
    and at each of ``intervals``, and the K of least stall (:func:`predict.auto_choice`, as
    ``overlap-ckpt aot``). ``hints``: the GPU copy schedule hint, as ``compile_ahead`` uses it
    (one copy per leaf, its compiler options, a latency profile per phase). ``mesh_shape``:
    the axis sizes of the arguments' mesh on the target (default: :mod:`.placement`'s rule).
    Nothing is allocated on the target; the plan is made without the host rehearsal
    ``prepare`` runs (which checks the host, not these programs)."""
    started = time.perf_counter()
    for k in [*(ks or []), *([] if window == "auto" else [window])]:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"window sizes are ints >= 1 (window may also be 'auto'), got {k!r}")
    target = get_target(target) if isinstance(target, str) else target
    if hints is not None and target.platform != "gpu":
        raise ValueError(f"the copy schedule hint is XLA:GPU's; target {target.name} is not a GPU: leave it off")
    user = UserStep.of(user)
    placement = Placement(target, mesh_shape)
    args, kwargs = placement.arguments(user.args, user.kwargs)
    state, door_args = _state(user, args, placement)
    step = placement.step(user.step)
    in_window = lower_in_window(step, *args, **kwargs)

    def lower(ticket):
        with placement.lowering():
            return in_window(ticket)

    options = hints.compiler_options() if hints else None
    plain, _ = compile_program("plain step", lower(None), options)
    log(f"plain step compiled in {plain.compile_s:.1f} s")
    with placement.lowering():
        reference, _ = compile_program("user step", step.lower(*args, **kwargs))
    if not (plain.flops or plain.matmul_flops):
        raise ValueError(f"{target.name}'s compiler gives no cost analysis and the step has no matmuls: nothing "
                         "to predict its time from")

    def plan(k):
        return plan_state(state, k, pack_outbox=False if hints else None, rehearse=False, **door_args)

    probe = WindowReport(target, plan(1), plain, (), reference)
    cost = predict.step_cost(probe, plain.matmul_flops or None)
    windows: dict[int, WindowReport] = {}

    def compile_k(k: int) -> int:
        p = probe.plan if k == 1 else plan(k)
        if p.k not in windows:
            phases = compiled_phases(lower, p, hints.prepare if hints else None, options)
            windows[p.k] = dataclasses.replace(probe, plan=p, phases=tuple(r for r, _ in phases))
            log(f"K={p.k}: {p.k} phase(s) compiled")
        return p.k

    labels, auto, chosen = _choose(compile_k, windows, cost, ks, window, interval, tuple(intervals))
    notes = _notes(user, state, door_args, placement, plain, hints, auto, time.perf_counter() - started)
    if chosen is not None:
        notes.insert(-1, f"the K the manager would use: {chosen} ({labels[chosen]})")
    return StepReport(_name(user.step), target, (args, kwargs), windows, labels, cost,
                      tuple(dict.fromkeys([*intervals, *([interval] if interval else [])])), chosen, auto,
                      {k: tuple(w.violations()) for k, w in windows.items()}, tuple(notes))


def _choose(compile_k: Callable[[int], int], windows: dict[int, WindowReport], cost: predict.StepCost,
            ks: Sequence[int] | None, window: int | str, interval: int | None, intervals: tuple[int, ...],
            ) -> tuple[dict[int, str], predict.AutoChoice | None, int | None]:
    """Compile the K asked for (see :func:`report_step`); their labels, what "auto" picks,
    and the K the manager would use."""
    if ks is not None:
        return {compile_k(k): "given" for k in ks}, None, None
    if window != "auto":
        k = compile_k(window)
        return {k: f"window={window}"}, None, k
    compile_k(1)
    auto = predict.auto_choice(windows[1], cost, dict.fromkeys([*([interval] if interval else []), *intervals]))
    labels = auto.labels()
    for k in list(labels):
        labels.setdefault(compile_k(k), labels[k])
    return labels, auto, compile_k(auto.by_interval[interval]) if interval else None


def _state(user: UserStep, args: tuple, placement: Placement) -> tuple[Any, dict]:
    """The train state among ``args`` (moved) and the door's arguments, moved too."""
    model = user.model
    if model is not None:
        where = next((i for i, a in enumerate(user.args) if a is model), None)
        model = args[where] if where is not None else placement.arguments((model,), {})[0][0]
    door_args = {"model": model, "graphdef": user.graphdef}
    refusals = []
    for arg in args:
        try:
            door_for(arg, **door_args)
            return arg, door_args
        except TypeError as e:
            refusals.append(str(e))
    specific = [r for r in refusals if not r.startswith("CheckpointManager needs")]
    raise StepError(specific[0] if specific else
                    "none of the step's arguments is a state overlap_ckpt checkpoints (an overlap_ckpt.TrainState, "
                    "an overlap_ckpt.nnx.Optimizer with its model, or the nnx.State of one with its graphdef); got "
                    + ", ".join(type(a).__name__ for a in user.args))


def _notes(user: UserStep, state: Any, door_args: dict, placement: Placement, plain: Any,
           hints: ScheduleHints | None, auto: predict.AutoChoice | None, seconds: float) -> list[str]:
    door = door_for(state, **door_args)
    params = sum(x.size for x in jax.tree.leaves(door.parts(state).params))
    meshes = "; ".join(f"mesh {dict(m.shape)} -> {dict(t.shape)}" for m, t in placement.moved_meshes().items())
    return [f"step: `{_name(user.step)}` ({door.name} state, {params:,} parameters), its arguments moved onto "
            f"{len(placement.target.devices)} {placement.target.name} device(s) "
            + (f"({meshes})" if meshes else "(replicated: no mesh among them)"),
            f"flops per device: {plain.matmul_flops:.3g} in the scheduled program's matmuls (the step time's flops "
            f"where the compiler gives none, or undercounts them as XLA:GPU does), {analysis_note(plain)}",
            *run_notes(hints.compiler_options() if hints else None, auto is not None,
                       auto.fraction if auto else None, seconds, auto.capacity_bytes if auto else None)]


def _name(step: Any) -> str:
    return getattr(step, "__name__", None) or getattr(getattr(step, "fun", None), "__name__", type(step).__name__)
