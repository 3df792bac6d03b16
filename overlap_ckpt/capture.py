"""Device side: the in-graph capture that a jitted train step performs in a window phase.

The step returns, next to its new state, an *outbox* of arrays placed in ``pinned_host``
memory: XLA schedules those device-to-host copies asynchronously alongside the step's
compute, and because they read the step's *input* buffers inside the same program,
donation stays correct (DESIGN.md section 3). What goes into the outbox at phase ``j``
of a K-step window:

* ``state``: slice ``j`` of the input params and the optimizer-state leaves they own;
* ``shared``: the shared optimizer-state leaves (counters, hyperparameters), whole;
* ``grads`` (j < K-1): this step's gradient pieces for slices ``0..j``;
* ``globals`` (j < K-1): the scalars the host cannot recompute from slices;
* ``extras`` (j = K-1): everything else in the train state, taken at the target version.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .jaxpr_interp import interpret
from .plan import CapturePlan, LeafLayout
from .separability import flat_update_fn, input_tokens
from .slicing import Piece

Outbox = dict[str, list[jax.Array]]


def to_host(x: jax.Array, layout: LeafLayout, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """Place ``x`` in pinned host memory, keeping its device layout (per-shard copies)."""
    sharding = sharding or layout.sharding
    return jax.device_put(x, sharding.with_memory_kind("pinned_host"))


def take_rows(x: jax.Array, layout: LeafLayout, piece: Piece) -> jax.Array:
    """Rows ``[start, stop)`` of every local block of ``x``, moved to pinned host memory.

    When axis 0 is sharded, the rows are taken inside each shard with ``shard_map`` so no
    device exchanges data; the result keeps the leaf's sharding.
    """
    if not layout.shape or (piece.start == 0 and piece.stop == layout.rows):
        return to_host(x, layout)
    sharding = layout.sharding
    if isinstance(sharding, NamedSharding) and len(sharding.spec) and sharding.spec[0] is not None:
        spec = sharding.spec
        local = jax.shard_map(lambda block: block[piece.start:piece.stop], mesh=sharding.mesh,
                              in_specs=spec, out_specs=spec)
        return to_host(local(x), layout, NamedSharding(sharding.mesh, spec))
    return to_host(x[piece.start:piece.stop], layout)


def global_dtypes(signature) -> list[str]:
    """The dtypes of the packed global arrays, in order of first appearance."""
    return list(dict.fromkeys(dtype for _, dtype in signature))


def pack_globals(cuts: list[jax.Array]) -> list[jax.Array]:
    """One array per dtype instead of one transfer per scalar (hundreds per step for a
    large tree under clip_by_global_norm)."""
    groups: dict[str, list[jax.Array]] = {}
    for c in cuts:
        groups.setdefault(str(jnp.dtype(c.dtype)), []).append(jnp.reshape(c, ()))
    return [jnp.stack(values) for values in groups.values()]


def unpack_globals(packed: list, signature) -> list:
    """Inverse of :func:`pack_globals` on the host, given the plan's cut signature."""
    columns = dict(zip(global_dtypes(signature), packed))
    taken: dict[str, int] = {}
    out = []
    for _, dtype in signature:
        i = taken.get(dtype, 0)
        out.append(columns[dtype][i])
        taken[dtype] = i + 1
    return out


def scalar_host_sharding(plan: CapturePlan) -> jax.sharding.Sharding:
    """Where global scalars go: replicated over the state's mesh, in host memory."""
    sharding = plan.params[0].sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind="pinned_host")
    return sharding.with_memory_kind("pinned_host")


def recorded_update(plan: CapturePlan, params, opt_state, grads) -> tuple[Any, Any, list[jax.Array]]:
    """Run the user's update while recording the global scalars the host will need."""
    params_leaves = jax.tree.leaves(params)
    state_leaves = jax.tree.leaves(opt_state)
    flat = flat_update_fn(plan.update, plan.params_def, plan.state_def)
    n, m = len(params_leaves), len(state_leaves)
    outs, interp = interpret(flat, "record", [*params_leaves, *state_leaves, *jax.tree.leaves(grads)],
                             input_tokens(n, m))
    values = [o.value for o in outs]
    return (jax.tree.unflatten(plan.params_def, values[:n]),
            jax.tree.unflatten(plan.state_def, values[n:]), interp.cuts)


def isolated(plan: CapturePlan, fn: Callable, step: Any, params, opt_state, grads):
    """``fn(params, opt_state, grads)`` compiled so that XLA cannot fuse the backward pass
    into it.

    Otherwise XLA duplicates the gradient computation into the update's fusions and
    rounds it differently from the gradient copy it ships to the host, and the host
    replay (where the gradient is an input) is off by an ulp. GPU/TPU compilers honour an
    optimization barrier. XLA:CPU removes barriers before fusion, so there the update runs
    in a conditional on a runtime predicate that is always true (``step >= 0``): a
    conditional's operands are materialised buffers and its branch is compiled as a
    computation of its own, like the host replay program.
    """
    if plan.platform != "cpu":
        return fn(params, opt_state, jax.lax.optimization_barrier(grads))
    if step is None:
        raise ValueError("capture_update needs the runtime step counter (step=...) on the CPU backend")
    out_shape = jax.eval_shape(fn, params, opt_state, grads)
    return jax.lax.cond(jnp.asarray(step) >= 0, lambda ops: fn(*ops),
                        lambda ops: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape),
                        (params, opt_state, grads))


def capture_update(plan: CapturePlan, phase: int | None, params, opt_state, grads,
                   extras: Any = None, *, step: Any = None) -> tuple[Any, Any, Outbox | None]:
    """The optimizer update of a train step, plus the outbox of window phase ``phase``.

    Call inside ``jit`` with ``plan`` and ``phase`` static. Outside a window (``phase is
    None``) this is the user's update with no capture.

    ``step`` (the runtime step counter) lets the CPU backend isolate the update, see
    :func:`isolated`; it is applied at every step, not only in windows, so that training
    follows the same trajectory whatever the checkpoint schedule.
    """
    if phase is None:
        new_params, new_state = isolated(plan, plan.update, step, params, opt_state, grads)
        return new_params, new_state, None
    k = plan.k
    if not 0 <= phase < k:
        raise ValueError(f"window phase {phase} outside 0..{k - 1}")
    last = phase == k - 1
    if plan.analysis.n_globals and not last:
        new_params, new_state, cuts = isolated(
            plan, lambda *a: recorded_update(plan, *a), step, params, opt_state, grads)
    else:
        (new_params, new_state), cuts = isolated(plan, plan.update, step, params, opt_state, grads), []
    outbox = capture_state(plan, phase, params, opt_state, extras)
    if not last:
        outbox["grads"], outbox["globals"] = capture_grads(plan, phase, grads, cuts)
    return new_params, new_state, outbox


def capture_state(plan: CapturePlan, phase: int, params, opt_state, extras: Any) -> Outbox:
    """The state part of phase ``phase``'s outbox: slice ``phase`` of the (input) params and
    the state leaves they own, the shared state leaves, and at the last phase the extras."""
    params_leaves, state_leaves = jax.tree.leaves(params), jax.tree.leaves(opt_state)
    outbox: Outbox = {"state": [], "shared": [], "grads": [], "globals": [], "extras": []}
    for piece in plan.slicing.slices[phase]:
        outbox["state"].append(take_rows(params_leaves[piece.leaf], plan.params[piece.leaf], piece))
        for j in plan.analysis.owned_state(piece.leaf):
            outbox["state"].append(take_rows(state_leaves[j], plan.state[j], plan.state_piece(j, piece)))
    outbox["shared"] = [to_host(state_leaves[j], plan.state[j]) for j in plan.analysis.shared_state]
    if phase == plan.k - 1:
        outbox["extras"] = [to_host(x, layout) for x, layout in zip(jax.tree.leaves(extras), plan.extras)]
    return outbox


def capture_grads(plan: CapturePlan, phase: int, grads, cuts: list) -> tuple[list, list]:
    """The gradient pieces slices ``0..phase`` need, and the packed global scalars."""
    grads_leaves = jax.tree.leaves(grads)
    pieces = [take_rows(grads_leaves[p.leaf], plan.params[p.leaf], p) for p in plan.slicing.pieces_upto(phase)]
    host = scalar_host_sharding(plan)
    return pieces, [jax.device_put(packed, host) for packed in pack_globals(cuts)]
