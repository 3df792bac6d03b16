"""Decide, before the first window, whether and how an optax update can be replayed on slices.

The user's transformation is traced once on the real tree and interpreted with
:mod:`overlap_ckpt.jaxpr_interp`. From the input leaves each output depends on we learn:

* which optimizer-state leaves belong to which parameter leaf (``mu``/``nu`` of a kernel)
  and which are shared (step counts, injected hyperparameters, MultiSteps counters);
* how many global scalars the device must ship per step (norms, finite flags);
* whether the update is elementwise once those scalars are known, so leaves may be split
  into row chunks, or reduces within a leaf (adafactor, muon), so slices must hold
  whole leaves.

Anything that mixes two leaves in a non-scalar way is refused here, naming the leaves,
because no slicing could replay it exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax
import optax

from ..errors import UnsupportedOptimizerError, brief, internal_error
from .interp import InterpretError, Tokens, interpret

UpdateFn = Callable[[Any, Any, Any], tuple[Any, Any]]
StepFn = Callable[[Any, Any, Any], tuple[Any, Any, Any]]

# The optax transformations whose replay CI checks bit for bit (tests/core/test_engine_bitwise.py),
# as docs/optimizers.md names them; refusal messages point here. Others are analysed from
# their program like these, and refused before training when they cannot be replayed.
KNOWN_EXACT_OPTIMIZERS = (
    "sgd", "adam", "adamw", "lion", "rmsprop", "adagrad", "adabelief", "lamb", "lars", "adafactor",
    "clip_by_global_norm", "clip", "apply_if_finite", "MultiSteps", "inject_hyperparams",
    "adaptive_grad_clip", "ema", "contrib.prodigy", "contrib.cocob", "contrib.dowg", "nadamw", "radam", "yogi",
    "adan", "amsgrad", "adamax", "multi_transform", "novograd", "contrib.schedule_free_adamw", "contrib.ademamix",
    "contrib.adopt", "contrib.dadapt_adamw", "contrib.mechanize", "contrib.madgrad", "optimistic_adam_v2", "rprop",
)


def optax_step_fn(tx: optax.GradientTransformation) -> StepFn:
    """``(params, opt_state, grads) -> (new_params, new_opt_state, updates)``, exactly as
    ``flax.training.train_state.TrainState.apply_gradients`` computes it, with the updates
    it applied (what ``nnx.Optimizer.update`` returns)."""

    def step(params, opt_state, grads):
        updates, new_opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state, updates

    return step


def optax_update_fn(tx: optax.GradientTransformation) -> UpdateFn:
    """``(params, opt_state, grads) -> (new_params, new_opt_state)``: :func:`optax_step_fn`
    without the updates."""
    step = optax_step_fn(tx)

    def update(params, opt_state, grads):
        new_params, new_opt_state, _ = step(params, opt_state, grads)
        return new_params, new_opt_state

    return update


def flat_update_fn(update: UpdateFn | StepFn, params_def, state_def, *, with_updates: bool = False) -> Callable:
    """The update as a function of flat leaf lists, which the interpreter labels.

    ``with_updates``: ``update`` is a :data:`StepFn` and the leaves of its updates follow
    the new params and state (they are intermediate values of the same program, so the
    global scalars it records and reads are the same)."""
    n_params = params_def.num_leaves
    n_state = state_def.num_leaves

    def flat(*leaves):
        params = jax.tree.unflatten(params_def, leaves[:n_params])
        state = jax.tree.unflatten(state_def, leaves[n_params:n_params + n_state])
        grads = jax.tree.unflatten(params_def, leaves[n_params + n_state:])
        new_params, new_state, *updates = update(params, state, grads)
        new_params_leaves, new_params_def = jax.tree.flatten(new_params)
        new_state_leaves, new_state_def = jax.tree.flatten(new_state)
        if new_params_def != params_def or new_state_def != state_def:
            raise UnsupportedOptimizerError(
                "the optimizer update changes the structure of params or opt_state; "
                "overlap_ckpt needs a structure-preserving update.")
        return [*new_params_leaves, *new_state_leaves, *(jax.tree.leaves(updates[0]) if with_updates else ())]

    return flat


def input_tokens(n_params: int, n_state: int) -> list[Tokens]:
    """Labels for (params, state, grads): a leaf's param and grad share its token."""
    return ([Tokens({("p", k)}) for k in range(n_params)]
            + [Tokens({("s", j)}) for j in range(n_state)]
            + [Tokens({("p", k)}) for k in range(n_params)])


@dataclasses.dataclass(frozen=True)
class UpdateAnalysis:
    """What the replay needs to know about one optax update on one tree."""

    n_params: int
    state_owner: tuple[int | None, ...]  # per opt_state leaf: owning param leaf, or None if shared
    chunkable: bool  # True: elementwise given the global scalars; leaves may be row-chunked
    why_not_chunkable: str = ""
    cut_signature: tuple[tuple[str, str], ...] = ()  # (primitive, dtype) of each global scalar
    cut_read: tuple[bool, ...] = ()  # per global scalar: read by more than scalar arithmetic, so shipped

    @property
    def shipped_signature(self) -> tuple[tuple[str, str], ...]:
        """(primitive, dtype) of each global scalar the device ships, in order."""
        return tuple(s for s, read in zip(self.cut_signature, self.cut_read) if read)

    @property
    def n_globals(self) -> int:
        """Scalars the device ships per step."""
        return sum(self.cut_read)

    def owned_state(self, k: int) -> list[int]:
        return [j for j, owner in enumerate(self.state_owner) if owner == k]

    @property
    def shared_state(self) -> list[int]:
        return [j for j, owner in enumerate(self.state_owner) if owner is None]


def analyze_update(update: UpdateFn, params, opt_state) -> UpdateAnalysis:
    """Trace ``update`` on the abstract tree and classify it (see module docstring)."""
    params_leaves, params_def = jax.tree.flatten(params)
    state_leaves, state_def = jax.tree.flatten(opt_state)
    n, m = len(params_leaves), len(state_leaves)
    param_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    state_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
    flat = flat_update_fn(update, params_def, state_def)
    labels: list = []

    def traced(*leaves):
        outs, interp = interpret(flat, "record", leaves, input_tokens(n, m))
        labels.append((outs, tuple(interp.signature), interp.co_reads,
                       tuple(i in interp.read for i in range(len(interp.signature)))))
        return [o.value for o in outs]

    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in [*params_leaves, *state_leaves, *params_leaves]]
    try:
        with blame(flat, abstract, "on this train state", "analysing the optimizer's program"):
            jax.eval_shape(traced, *abstract)
    except InterpretError as e:
        raise UnsupportedOptimizerError(str(e)) from e
    outs, signature, co_reads, read = labels[0]
    new_params, new_state = outs[:n], outs[n:]

    def param_tokens(tokens) -> set[int]:
        return {k for kind, k in tokens if kind == "p"}

    owner: list[int | None] = []
    for j, out in enumerate(new_state):
        ks = param_tokens(out.tokens)
        if len(ks) > 1:
            raise UnsupportedOptimizerError(
                f"optimizer state leaf opt_state{state_paths[j]} is computed from several "
                f"parameter leaves ({', '.join('params' + param_paths[k] for k in sorted(ks)[:4])}) "
                "by a non-scalar operation, so it cannot be replayed one slice at a time. "
                "Use a per-leaf optimizer, or take synchronous checkpoints (window=1 with "
                "replay disabled) for this optimizer.")
        owner.append(next(iter(ks)) if ks else None)
    for j in range(m):
        if owner[j] is None:
            owner[j] = _read_with(j, co_reads, state_leaves, params_leaves, state_paths, param_paths)

    def check(out, own: int | None, what: str) -> None:
        for kind, idx in out.tokens:
            other = idx if kind == "p" else owner[idx]
            if other is not None and other != own:
                source = f"params{param_paths[other]}"
                raise UnsupportedOptimizerError(
                    f"{what} depends on {source} through a non-scalar operation (a transform "
                    "that mixes leaves, e.g. a per-group norm or a flattening optimizer); "
                    "it cannot be replayed on slices. Known-good optimizers: "
                    f"{', '.join(KNOWN_EXACT_OPTIMIZERS)}.")

    for k, out in enumerate(new_params):
        check(out, k, f"the update of params{param_paths[k]}")
    for j, out in enumerate(new_state):
        check(out, owner[j], f"optimizer state leaf opt_state{state_paths[j]}")

    reasons = [f"params{param_paths[k]}" for k, o in enumerate(new_params) if o.nonelementwise]
    reasons += [f"opt_state{state_paths[j]}" for j, o in enumerate(new_state) if o.nonelementwise]
    for j, k in enumerate(owner):
        if k is not None and tuple(state_leaves[j].shape) != tuple(params_leaves[k].shape):
            reasons.append(f"opt_state{state_paths[j]} (shape {tuple(state_leaves[j].shape)} "
                           f"differs from its parameter's {tuple(params_leaves[k].shape)})")
    why = ""
    if reasons:
        why = ("the update reduces within a leaf (e.g. factored or matrix statistics) for "
               + ", ".join(reasons[:3]) + (" ..." if len(reasons) > 3 else ""))
    return UpdateAnalysis(n, tuple(owner), not reasons, why, signature, read)


@contextlib.contextmanager
def blame(flat: Callable, args: list, where: str, doing: str) -> Iterator[None]:
    """Report a failure inside the block as the optimizer's or as ours, never ours as theirs.

    Our analysis and replay run the user's update ``flat`` through :mod:`.interp`, so a
    failure there may come from the optimizer or from us (a bug, a JAX API missing from an
    old release). A refusal (:class:`InterpretError`, :class:`UnsupportedOptimizerError`)
    passes as it is. Any other failure is settled by tracing ``flat`` alone on the same
    abstract ``args``: if that fails too, the optimizer cannot run ``where``
    (:class:`UnsupportedOptimizerError`); if not, the fault is ours (``InternalError``).
    The extra trace runs only on failure, so it costs nothing otherwise.
    """
    try:
        yield
    except (InterpretError, UnsupportedOptimizerError):
        raise
    except Exception as e:  # noqa: BLE001 - classified below
        try:
            jax.eval_shape(flat, *args)
        except UnsupportedOptimizerError:
            raise
        except Exception as own:  # noqa: BLE001 - the optimizer itself fails on these arguments
            raise UnsupportedOptimizerError(
                f"the optimizer's update fails {where} ({type(own).__name__}: "
                f"{brief(own)}). overlap_ckpt replays tx.update(grads, opt_state, params) on "
                "the params tree as the train state holds it; optimizers that need another params "
                "type (optax.lookahead's LookaheadParams) or extra update arguments are not "
                "supported.") from own
        raise internal_error(doing, e) from e


def _read_with(j: int, co_reads, state_leaves, params_leaves, state_paths, param_paths) -> int | None:
    """The parameter leaf that state leaf ``j`` is read with element by element, if any.

    Optimizers such as prodigy, cocob and dowg keep a frozen copy of the initial params
    and compare it with the params (``p0 - p``). The copy is never written, so its outputs
    name no parameter, but it must be sliced with its parameter: shipped whole every phase
    it would cost a second copy of the params per step, and a slice replay would compare
    a whole leaf with a chunk.
    """
    partners: set[int] = set()
    for tokens in co_reads:
        if ("s", j) in tokens:
            partners |= {k for kind, k in tokens if kind == "p"}
    if not partners:
        return None
    if len(partners) > 1:
        raise UnsupportedOptimizerError(
            f"optimizer state leaf opt_state{state_paths[j]} is read element by element with several "
            f"parameter leaves ({', '.join('params' + param_paths[k] for k in sorted(partners)[:4])}); "
            "it cannot be replayed one slice at a time.")
    k = next(iter(partners))
    if tuple(state_leaves[j].shape) != tuple(params_leaves[k].shape):
        return None  # broadcast against a differently shaped leaf: keep it shared
    return k
