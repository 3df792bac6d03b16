"""Device side: what a jitted train step does in a window phase, and nothing outside one.

A step learns that it is in a window from a :class:`WindowTicket` that rides into it in
the train state (where the outbox comes back out). The ticket is a *static* pytree node:
it has no leaves, so it changes nothing the step computes on, but it is part of the
argument's tree structure, so ``jax.jit`` compiles one variant per window phase and
reuses it. Outside a window the state carries ``None`` there and the step is the user's
own program, untouched.

The outbox of phase ``j`` of a K-step window (:class:`Outbox`):

* ``state``: slice ``j`` of the input params and the optimizer-state leaves they own;
* ``shared``: the shared optimizer-state leaves (counters, hyperparameters), whole;
* ``grads`` (j < K-1): this step's gradient pieces for slices ``0..j``;
* ``globals`` (j < K-1): the scalars the host cannot recompute from slices;
* ``extras`` (j = K-1): everything else in the train state, taken at the target version
  (in the step when the step sees them unchanged, as Linen's ``apply_gradients`` does; by
  the door just before the step otherwise, see :func:`overlap_ckpt.core.fallback.capture_before_step`).

The copies read the step's *input* buffers inside the same program, so donation stays
correct, and they are placed in the plan's host memory kind (``pinned_host``) so XLA
schedules them as asynchronous device-to-host copies beside the step's compute. On GPU
those lists travel packed, one copy per element width (:mod:`overlap_ckpt.core.packing`);
on TPU only their small items do, the others keep a copy each.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from . import packing, scalars
from .interp import InterpretError, interpret
from .plan import CapturePlan, LeafLayout
from .ticket import Outbox, WindowTicket
from .separability import flat_update_fn, input_tokens, optax_step_fn
from .slicing import Piece

HOST_KIND = "pinned_host"  # the memory kind jax.memory.Space.Host means on every backend


_LEAD_AXES = contextvars.ContextVar("overlap_ckpt_lead_axes", default=0)


def lead_axes(plans: Any) -> int:
    """One more leading axis of size 1 than any leaf of the plans' states has (see :func:`to_host`)."""
    def units(shape: tuple[int, ...]) -> int:
        return next((i for i, n in enumerate(shape) if n != 1), len(shape))
    return 1 + max(units(tuple(layout.shape)) for plan in plans
                   for layout in (*plan.params, *plan.state, *plan.extras))


@contextlib.contextmanager
def _leading_axes(n: int) -> Iterator[None]:
    token = _LEAD_AXES.set(n)
    try:
        yield
    finally:
        _LEAD_AXES.reset(token)


def to_host(x: jax.Array, plan: CapturePlan, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` placed in the plan's outbox memory, keeping its device layout (per-shard copies).

    The host placement is ``jax.device_put(..., jax.memory.Space.Host)`` rather than a
    sharding with ``memory_kind="pinned_host"``: compile-only GPU devices (deviceless AOT)
    list no memories and silently drop a sharding's memory kind, leaving the copy on the
    device, while the memory space survives on every backend (CPU, GPU, TPU; XLA turns it
    into an asynchronous ``copy-start``/``copy-done`` to ``S(5)``). The device placement
    comes first, as a sharding constraint, so that small leaves kept on one device reach
    the state's mesh (see :func:`overlap_ckpt.core.plan._on_state_devices`).
    A plan without an outbox memory kind (``jax.pmap``, whose outputs always live in device
    memory) leaves the array where it is; the door copies it to the host after the step.
    Another memory kind than ``pinned_host`` (emulation in tests) is placed by sharding.

    Leading unit axes (:func:`lead_axes`, set by :func:`capture_update`): ``jax.jit`` pairs
    each donated input with the first output of the same shape and dtype, and without
    ``out_shardings`` it ignores memory kinds. A donated array the step returns after the
    state (an EMA of the params, a second managed state) could be paired with a host copy
    of the same shape, and the runtime then aborts the process ("PjRtBuffer's memory kind
    does not match"). With more leading unit axes than any managed leaf has, no host copy
    has the shape of a leaf, nor of anything shaped like one. The host drops them
    (:func:`overlap_ckpt.core.buffers.unlead`).

    The copy in host memory is constrained to the layout too, not only the array before it:
    where the step's ``out_shardings`` leave the outbox unspecified (a sharding tree taken
    from the state, whose outbox is ``None``), XLA's propagation placed a host copy
    otherwise than its source (a replicated bias's gradient came back sharded like its
    consumer), and the host, which keeps blocks as the plan lays them out, did not receive
    the blocks it keeps: every checkpoint of such a loop failed.
    """
    if plan.outbox_memory is None:
        return x
    if jax.sharding.get_abstract_mesh().manual_axes:
        # Inside jax.pmap with a broadcast state (in_axes=None): every device holds the whole
        # leaf and no placement on the state's devices applies. pmap brings its outputs back
        # in device memory, replicated; the engine copies replica 0 to the host.
        return jax.device_put(x, jax.memory.Space.Host)
    if plan.outbox_memory != HOST_KIND:
        return jax.device_put(x, sharding.with_memory_kind(plan.outbox_memory))
    lead = _LEAD_AXES.get()
    if lead:
        x = x.reshape((1,) * lead + x.shape)
        sharding = _with_lead_axes(sharding, lead)
    with mesh_of(sharding):
        x = jax.device_put(jax.device_put(x, sharding), jax.memory.Space.Host)
        if isinstance(sharding, NamedSharding):  # the host copy itself keeps the layout (see above)
            x = jax.lax.with_sharding_constraint(x, sharding.with_memory_kind(HOST_KIND))
    return x


def mesh_of(sharding: jax.sharding.Sharding) -> contextlib.AbstractContextManager:
    """The state's mesh as the trace's context, where its axes are explicit and the step was
    traced without one.

    Why: ``jax.make_mesh`` makes explicit axes by default (jax 0.10), and a loop may place
    its state on such a mesh with ``jax.device_put`` and jit its step without ``jax.set_mesh``.
    The step then traces with no mesh in context, and a sharding constraint that names an
    explicit axis is refused ("can only refer to Auto axes"): the first window step of such a
    loop failed while its plain steps ran. Under the mesh, as under ``jax.set_mesh``, the
    arrays carry their layout in their types, and the constraint checks it instead."""
    if (not isinstance(sharding, NamedSharding) or not jax.sharding.get_abstract_mesh().empty
            or jax.sharding.AxisType.Explicit not in sharding.mesh.axis_types):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(sharding.mesh.abstract_mesh)


def _with_lead_axes(sharding: jax.sharding.Sharding, lead: int) -> jax.sharding.Sharding:
    """``sharding`` for the same array with ``lead`` unit axes in front."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*(None,) * lead, *sharding.spec),
                             memory_kind=sharding.memory_kind)
    return sharding


def take_rows(x: jax.Array, layout: LeafLayout, piece: Piece, plan: CapturePlan) -> jax.Array:
    """Rows ``[start, stop)`` of every local block of ``x``, moved to the outbox memory.

    When axis 0 is sharded, the rows are taken inside each shard with ``shard_map`` so no
    device exchanges data; the result keeps the leaf's sharding.
    """
    if not layout.shape or (piece.start == 0 and piece.stop == layout.rows):
        return to_host(x, plan, layout.sharding)
    sharding = layout.sharding
    if isinstance(sharding, NamedSharding) and len(sharding.spec) and sharding.spec[0] is not None:
        spec = sharding.spec
        local = jax.shard_map(lambda block: block[piece.start:piece.stop], mesh=sharding.mesh,
                              in_specs=spec, out_specs=spec)
        return to_host(local(x), plan, NamedSharding(sharding.mesh, spec))
    return to_host(x[piece.start:piece.stop], plan, sharding)


def scalars_to_host(plan: CapturePlan, packed: list[jax.Array]) -> list[jax.Array]:
    """Global scalars in the outbox memory, replicated over the state's mesh (a scalar has
    no layout of its own: it goes where the first parameter's devices are)."""
    if plan.outbox_memory is None:
        return packed
    sharding = plan.params[0].sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec())
    return [to_host(x, plan, sharding) for x in packed]


def recorded_update(plan: CapturePlan, params, opt_state, grads,
                    step: Any = None) -> tuple[Any, Any, Any, list[jax.Array]]:
    """Run the user's update while recording the global scalars the host will need:
    ``(new_params, new_opt_state, updates, global scalars)``.

    With the runtime step counter on the CPU backend, the update reads each shipped scalar
    through :func:`cut_barrier`, as the host replay does."""
    params_leaves = jax.tree.leaves(params)
    state_leaves = jax.tree.leaves(opt_state)
    flat = flat_update_fn(optax_step_fn(plan.tx), plan.params_def, plan.state_def, with_updates=True)
    n, m = len(params_leaves), len(state_leaves)
    barrier = cut_barrier(step) if plan.platform == "cpu" and step is not None else None
    outs, interp = interpret(flat, "record", [*params_leaves, *state_leaves, *jax.tree.leaves(grads)],
                             input_tokens(n, m), read=plan.analysis.cut_read, barrier=barrier,
                             replayed_outputs=n + m)
    read = tuple(i in interp.read for i in range(len(interp.signature)))
    if read != plan.analysis.cut_read:
        raise InterpretError("the update reads other global scalars in this step than when it was "
                             "planned; re-plan (plan_for) with this step's state.")
    values = [o.value for o in outs]
    return (jax.tree.unflatten(plan.params_def, values[:n]), jax.tree.unflatten(plan.state_def, values[n:n + m]),
            jax.tree.unflatten(plan.params_def, values[n + m:]), interp.read_cuts())


def isolated_gradients(plan: CapturePlan, step: Any, grads):
    """``grads`` as a materialised buffer, so that XLA cannot fuse the backward pass into
    the update that reads them.

    Otherwise XLA duplicates the gradient computation into the update's fusions and rounds
    it differently from the gradient copy it ships to the host, and the host replay (where
    the gradient is an input) is off by an ulp. GPU/TPU compilers honour an optimization
    barrier, one per leaf: a barrier over the whole tree would hold every gradient until
    the last one is computed (on the compile-only H100, 0.75 MB of the tiny Linen LM's
    window phase beyond the plain step), where each leaf's update may otherwise run as soon
    as its gradient is ready. XLA:CPU removes barriers before fusion, so there the gradients
    go through a conditional on a runtime predicate that is always true
    (:func:`always_true`), whose taken branch is the identity: a conditional's result is a
    materialised buffer. Only the
    gradients are copied; the update stays in the step and writes the donated state in
    place. (A conditional around the whole update cannot alias donated buffers: it copied
    every state leaf, about 9% of a 20M-parameter LM's step on the CPU.)

    On XLA:CPU the gradients enter the conditional in their units' capture layout, the
    blocks the host replays (and the captured pieces' layout, so those cost no second
    reshard): the update then runs on those blocks, as the replay does. Left to XLA, the
    gradient of a replicated kernel came out sharded on columns with ``out_shardings``
    from the state, and the kernel's update was computed in column-major fusions whose
    rounding the host does not reproduce (see :func:`updated_apart`).
    """
    if plan.platform != "cpu":
        return jax.tree.map(jax.lax.optimization_barrier, grads)
    if step is None:
        raise ValueError("capture_update needs the runtime step counter (step=...) on the CPU backend")
    leaves, treedef = jax.tree.flatten(grads)
    leaves = [_constrained(g, layout.sharding) for g, layout in zip(leaves, plan.params)]
    return opaque(always_true(step), jax.tree.unflatten(treedef, leaves))


def _constrained(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` placed as ``sharding`` in the program (a mesh layout; not inside ``jax.pmap``)."""
    if not isinstance(sharding, NamedSharding) or jax.sharding.get_abstract_mesh().manual_axes:
        return x
    with mesh_of(sharding):
        return jax.lax.with_sharding_constraint(x, sharding)


def updated_apart(plan: CapturePlan, step: Any, params, opt_state) -> tuple[Any, Any]:
    """The new ``params`` and ``opt_state`` of a window step whose gradient the host replays
    (XLA:CPU), with each leaf that the state keeps in another layout than its unit's capture
    layout (:attr:`CapturePlan.apart`) computed in the capture layout, into a buffer of its
    own (:func:`opaque`), and only then placed back where the state keeps it.

    Why: the host replays each unit on the blocks of its capture layout, and XLA:CPU's
    rounding of an elementwise update depends on the layout of the fusion that computes it.
    With ``out_shardings`` taken from the state, replicated Adam moments beside a kernel
    sharded on columns were updated on the kernel's column blocks and all-gathered along
    axis 1 straight from the update's fusion. Layout assignment made that fusion
    column-major, LLVM's loop vectorizer swapped the operands of ``0.1 * g + 0.9 * mu``, and
    FMA contraction fused the other product: ``fma(mu, 0.9, 0.1 * g)`` on the device,
    ``fma(g, 0.1, 0.9 * mu)`` in the host's row-major replay, the moment up to 154 ulp off.
    A sharding constraint alone does not help (the fusion still feeds the all-gather); the
    conditional's output is a buffer the update writes row-major, and the collective reads
    that. Cost: a copy of those leaves' blocks per step, in these window steps only.
    """
    if not plan.apart:
        return params, opt_state
    taken = always_true(step)
    leaves = jax.tree.leaves(params) + jax.tree.leaves(opt_state)
    layouts = [*plan.params, *plan.state]
    for i, placed in plan.apart:
        leaves[i] = _constrained(opaque(taken, _constrained(leaves[i], layouts[i].sharding)), placed)
    n = len(plan.params)
    return jax.tree.unflatten(plan.params_def, leaves[:n]), jax.tree.unflatten(plan.state_def, leaves[n:])


def cut_barrier(step: Any) -> Callable[[jax.Array], jax.Array]:
    """The device's barrier at a shipped global scalar (XLA:CPU): the update goes on with
    the output of a conditional on :func:`always_true` whose taken branch is the identity,
    an opaque copy of the value it ships.

    Why: the host replay takes the scalar from the device instead of computing it, and what
    feeds a value decides how XLA fuses it. ``MultiSteps`` around ``clip_by_global_norm``
    and Adam: on the device the accumulated gradient mean feeds the norm's reductions as
    well as the clipping, so XLA kept it in a buffer of its own; on the host, where nothing
    computed the norm from it, XLA fused the mean into the clipping and rounded the moments
    otherwise (the last bit). Behind a barrier on both sides (the host's picks the device's
    value beside the one it computed, :func:`overlap_ckpt.core.replay.host_cut_barrier`),
    the reductions stay in both programs and the clipping reads an opaque scalar on both.
    """
    taken = always_true(step)
    return lambda value: opaque(taken, value)


def opaque(taken: jax.Array, tree: Any) -> Any:
    """``tree`` as the output of a conditional on ``taken`` (true at run time) whose taken
    branch is the identity: a materialised buffer XLA:CPU cannot see through or fuse into
    its readers. The other branch negates (inverts integers), so that XLA cannot merge the
    two branches."""
    def other(x: jax.Array) -> jax.Array:
        return jnp.negative(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.invert(x)
    return jax.lax.cond(taken, lambda t: t, lambda t: jax.tree.map(other, t), tree)


def always_true(step: Any) -> jax.Array:
    """A predicate that is true at run time but that XLA cannot fold to a constant.

    ``step >= 0`` is folded for unsigned counters (NNX's ``uint32`` step), which silently
    removes the conditional and with it the isolation. ``step`` is a training step counter:
    it never reaches its dtype's largest value.
    """
    step = jnp.asarray(step)
    if not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(f"the step counter must be an integer array, got {step.dtype}")
    return step != jnp.asarray(jnp.iinfo(step.dtype).max, step.dtype)


class CapturedUpdate(NamedTuple):
    """What :func:`captured_update` returns."""

    params: Any
    opt_state: Any
    outbox: Outbox | None
    updates: Any  # what tx.update returned and the new params applied (nnx.Optimizer.update returns it)


def capture_update(tx: optax.GradientTransformation, ticket: WindowTicket | None, params, opt_state,
                   grads, extras: Any = None, *, step: Any = None) -> tuple[Any, Any, Outbox | None]:
    """The optimizer update of a train step, plus the outbox of the ticket's window phase:
    ``(new_params, new_opt_state, outbox)`` (:func:`captured_update` without the updates).

    Call inside ``jit``. Without a ticket (outside a window) this is exactly the user's
    update, ``optax.apply_updates(params, tx.update(grads, opt_state, params))``, with
    nothing added, and the outbox is None. In the window phases whose gradients the host
    replays (all but the last), ``step`` (the runtime step counter) lets the CPU backend
    isolate the gradients from the backward pass (:func:`isolated_gradients`): those steps
    may differ from the same step without checkpointing in the last bits, while the
    checkpoint equals the live state of its version bit for bit.
    """
    new_params, new_state, outbox, _ = captured_update(tx, ticket, params, opt_state, grads, extras, step=step)
    return new_params, new_state, outbox


def captured_update(tx: optax.GradientTransformation, ticket: WindowTicket | None, params, opt_state,
                    grads, extras: Any = None, *, step: Any = None) -> CapturedUpdate:
    """:func:`capture_update` with the updates it applied, for doors whose update returns
    them (``nnx.Optimizer.update``). Unused, they cost nothing: ``jit`` drops them."""
    if ticket is None:
        new_params, new_state, updates = optax_step_fn(tx)(params, opt_state, grads)
        return CapturedUpdate(new_params, new_state, None, updates)
    with _leading_axes(max(ticket.lead_axes, lead_axes([ticket.plan]))):
        return _window_update(tx, ticket, params, opt_state, grads, extras, step)


def _window_update(tx: optax.GradientTransformation, ticket: WindowTicket, params, opt_state, grads,
                   extras: Any, step: Any) -> CapturedUpdate:
    plan = ticket.plan
    if plan.tx is not tx:
        raise ValueError("capture_update: the ticket was planned for another optax transformation "
                         "than the one given; plan with the optimizer the step uses")
    _check_shapes(plan, params)
    outbox = None
    if ticket.capture and plan.platform != "cpu":
        outbox, params, opt_state = captured_before_update(ticket, params, opt_state, extras)
    cuts: list = []
    # plan.update is optax_update_fn(plan.tx): the same program, here with its updates.
    if ticket.last:  # no gradient of this step is shipped or replayed: the update as it is
        new_params, new_state, updates = optax_step_fn(tx)(params, opt_state, grads)
    else:
        grads = isolated_gradients(plan, step, grads)
        if plan.analysis.n_globals:
            new_params, new_state, updates, cuts = recorded_update(plan, params, opt_state, grads, step)
        else:
            new_params, new_state, updates = optax_step_fn(tx)(params, opt_state, grads)
        if plan.platform == "cpu":
            new_params, new_state = updated_apart(plan, step, new_params, new_state)
    if not ticket.capture:
        # The same update as a captured step (its scalars stay outputs, so XLA compiles the
        # update the same way), without copies: the trajectory does not depend on skips.
        return CapturedUpdate(new_params, new_state, Outbox(ticket, [], [], [], scalars.pack(cuts), []), updates)
    if outbox is None:
        outbox = capture_state(ticket, params, opt_state, extras)
    if not ticket.last and outbox.packing is not None:
        capture_grads_packed(outbox, grads, cuts)
    elif not ticket.last:
        outbox.grads, outbox.globals = capture_grads(ticket, grads, cuts)
    return CapturedUpdate(new_params, new_state, outbox, updates)


def _check_shapes(plan: CapturePlan, params) -> None:
    """The update must see the arrays the plan was made for: inside ``shard_map`` (or
    ``vmap``) it sees per-device blocks, which no slice of the plan describes."""
    for x, layout in zip(jax.tree.leaves(params), plan.params):
        if tuple(x.shape) != layout.shape:
            raise TypeError(
                f"the optimizer update of a checkpoint window sees a parameter of shape {tuple(x.shape)} "
                f"where the train state holds {layout.shape}: apply_gradients / optimizer.update runs "
                "inside shard_map or vmap. Call it outside, on the global arrays (compute the "
                "gradients inside shard_map if you like).")


def captured_before_update(ticket: WindowTicket, params, opt_state, extras: Any) -> tuple[Outbox, Any, Any]:
    """The state part of the outbox, ordered before the update that overwrites it (GPU/TPU).

    The update writes the donated input buffers in place while the captures read them.
    With no order between the two, XLA:GPU's copy insertion first copies each captured
    input leaf into a device temporary (seen in the compile-only H100 program: a window cost
    an extra slice of device memory). An optimization barrier over (the captures, the state)
    makes the update wait for them, so they read the donated buffers themselves. The CPU
    backend keeps the capture after the update (its barriers are removed before fusion, and
    its programs stay bitwise as they were).

    What the update waits for decides where XLA schedules a packed outbox's host copy (seen
    in the compile-only H100 programs of the tiny and the 1B LM): a copy the update waits
    for starts before the forward pass and spans it and the backward pass; one it does not
    wait for may start only after the backward pass, beside the update alone. So in the
    phases that ship gradients, whose update already waits for all of them (see
    :func:`isolated_gradients`), it waits for the copies too. In the last phase it waits
    only for the packing, which reads the state: its per-leaf updates may then run during
    the backward pass as in the plain step (waiting for the copy there held every gradient
    until the end of the backward pass: 0.5 MB over the tiny LM's outbox), and XLA may
    start the copy at the beginning of the program: it did for the tiny LM, but for the
    20M-1B LMs it started it after 0.57-0.72 of the step's compute, where its own latency
    estimate for the copy ran out (compile-only H100, and an H200's trace: see
    benchmarks/results/gpu_h200_1b_copy_schedule.md). A packed array that is a view of one whole
    leaf (:func:`overlap_ckpt.core.packing.views`) is copied before the update in every
    phase: copied after it, it would read the donated buffer the update overwrites.
    """
    outbox = capture_state(ticket, params, opt_state, extras, place_packed=False)
    late = [False] * len(outbox.packed)  # copied after the barrier: the update does not wait
    if ticket.last and outbox.packing is not None:
        items = packing.phase_items(ticket.plan, ticket.phase, outbox.packing.extras).state_items()
        chosen = [item for item, packed in zip(items, packing.selected(ticket.plan, items)) if packed]
        late = [not view for view in packing.views(chosen)]
    outbox.packed = [x if wait else packed_to_host(ticket.plan, x) for x, wait in zip(outbox.packed, late)]
    (outbox.state, outbox.shared, outbox.packed), params, opt_state = jax.lax.optimization_barrier(
        ((outbox.state, outbox.shared, outbox.packed), params, opt_state))
    outbox.packed = [packed_to_host(ticket.plan, x) if wait else x for x, wait in zip(outbox.packed, late)]
    return outbox, params, opt_state


def packs(plan: CapturePlan) -> bool:
    """Whether this step packs its outbox (:mod:`overlap_ckpt.core.packing`): the plan says
    so, and the step is not inside ``jax.pmap`` (whose outputs stay in device memory)."""
    return plan.pack_outbox and plan.outbox_memory is not None and not jax.sharding.get_abstract_mesh().manual_axes


def packed_to_host(plan: CapturePlan, packed: jax.Array) -> jax.Array:
    """A packed array moved to the outbox memory: one asynchronous host copy."""
    return to_host(packed, plan, packing.packed_sharding(plan))


def capture_state(ticket: WindowTicket, params, opt_state, extras: Any, *, place_packed: bool = True) -> Outbox:
    """The state part of an outbox: slice ``phase`` of the (input) params and the state
    leaves they own, the shared state leaves, and at the last phase the extras.

    A packed outbox's arrays stay in device memory with ``place_packed=False`` (the caller
    moves them with :func:`packed_to_host`)."""
    plan = ticket.plan
    with_extras = ticket.last and extras is not None
    items = packing.phase_items(plan, ticket.phase, with_extras)
    sources = {"params": jax.tree.leaves(params), "state": jax.tree.leaves(opt_state),
               "extras": jax.tree.leaves(extras)}
    arrays = {name: [sources[source][item.piece.leaf] for source, item in entries] for name, entries in items.parts()}
    if not packs(plan):
        captured = [take_rows(x, item.layout, item.piece, plan) for x, (_, item) in zip(arrays["state"], items.state)]
        shared = [to_host(x, plan, item.layout.sharding) for x, (_, item) in zip(arrays["shared"], items.shared)]
        extras_out = capture_extras(ticket, extras) if with_extras else []
        return Outbox(ticket, captured, shared, [], [], extras_out)
    # Packed: the selected items in one array per element width, the others (large items on
    # TPU, see packing.selected) each in a copy of its own, in the lists, in item order.
    own: dict[str, list[jax.Array]] = {}
    selected: list[tuple[jax.Array, packing.Item]] = []
    for name, entries in items.parts():
        mask = packing.selected(plan, [item for _, item in entries])
        own[name] = [take_rows(x, item.layout, item.piece, plan)
                     for x, (_, item), packed in zip(arrays[name], entries, mask) if not packed]
        selected += [(x, item) for x, (_, item), packed in zip(arrays[name], entries, mask) if packed]
    packed = packing.pack([x for x, _ in selected], [item for _, item in selected], packing.packed_sharding(plan))
    return Outbox(ticket, own["state"], own["shared"], [], [], own["extras"],
                  packed=[packed_to_host(plan, x) for x in packed] if place_packed else packed,
                  packing=packing.Packing(extras=with_extras))


def capture_extras(ticket: WindowTicket, extras: Any) -> list[jax.Array]:
    """The extras of the target version, in host memory (the last phase's share)."""
    plan = ticket.plan
    return [to_host(x, plan, layout.sharding) for x, layout in zip(jax.tree.leaves(extras), plan.extras)]


def capture_grads(ticket: WindowTicket, grads, cuts: list) -> tuple[list, list]:
    """The gradient pieces slices ``0..phase`` need, and the packed global scalars."""
    plan = ticket.plan
    grads_leaves = jax.tree.leaves(grads)
    pieces = [take_rows(grads_leaves[p.leaf], plan.params[p.leaf], p, plan)
              for p in plan.slicing.pieces_upto(ticket.phase)]
    return pieces, scalars_to_host(plan, scalars.pack(cuts))


def capture_grads_packed(outbox: Outbox, grads, cuts: list) -> None:
    """Add the gradient pieces to a packed ``outbox``, the selected ones
    (:func:`overlap_ckpt.core.packing.selected`) as one host copy per element width (a group
    of their own: they are ready only after the backward pass), the others each in a copy
    of its own; and the global scalars."""
    ticket = outbox.ticket
    plan = ticket.plan
    grads_leaves = jax.tree.leaves(grads)
    items = packing.grad_items(plan, ticket.phase)
    mask = packing.selected(plan, items)
    chosen = [item for item, packed in zip(items, mask) if packed]
    packed = packing.pack([grads_leaves[item.piece.leaf] for item in chosen], chosen, packing.packed_sharding(plan))
    outbox.packed = outbox.packed + [packed_to_host(plan, x) for x in packed]
    outbox.grads = [take_rows(grads_leaves[item.piece.leaf], item.layout, item.piece, plan)
                    for item, packed_ in zip(items, mask) if not packed_]
    outbox.packing = dataclasses.replace(outbox.packing, grads=True)
    outbox.globals = scalars_to_host(plan, scalars.pack(cuts))
