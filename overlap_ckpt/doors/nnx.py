"""Flax NNX door: an ``nnx.Optimizer`` whose ``update`` captures checkpoint windows.

Usage with ``nnx.jit`` (the current NNX API, ``update(model, grads)``)::

    model = MyModel(rngs=nnx.Rngs(0))
    optimizer = overlap_ckpt.nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))          # donation is optional
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    with overlap_ckpt.CheckpointManager("/ckpt", save_interval_steps=1000) as mngr:
        mngr.prepare(optimizer, model)       # or mngr.restore(target_state=optimizer, model=model)
        for batch in data:
            train_step(model, optimizer, batch)
            mngr.step(optimizer)             # one call per step, never blocks

In the functional style (``graphdef, state = nnx.split((model, optimizer))`` and a plain
``jax.jit`` that merges, steps and returns ``nnx.state(...)``), the state is what flows::

    state = mngr.prepare(state, graphdef=graphdef)
    for batch in data:
        state, loss = train_step(graphdef, state, batch)
        state = mngr.step(state)

The optimizer holds nothing of overlap_ckpt: ``nnx.state(optimizer)``, ``nnx.split``,
``nnx.to_flat_state`` and everything that walks them see what ``nnx.Optimizer`` shows.
``update`` learns that it is in a window from the manager's window context
(:mod:`overlap_ckpt.core.window_context`, part of jit's cache key, so ``nnx.jit`` and a
plain ``jax.jit`` over a graphdef split once both compile one variant per window phase).
The host copies of a window step have to leave the jitted step as outputs: ``update``
puts them in a variable of their own (:class:`WindowOutbox`) that exists only from that
step until the ``mngr.step`` that takes it.

What is saved (plain nested dicts, readable by stock Orbax)::

    {"step": optimizer.step, "params": <wrt state of the model>, "opt_state": <optax state>,
     "model_state": <the rest of the model's state, e.g. BatchStat; omitted when empty>}
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from ..core import backend
from ..core.capture import captured_update
from ..core.extra_args import check_extra_update_args
from ..core.ticket import Outbox
from ..core.window_context import is_planned, ticket_for
from .base import Parts, abstract_parts, committed, host_copy, keys_as_data, keys_like, refuse_stale_outbox

_OUTBOX = "zz_ckpt_outbox"
_NO_GRADS = object()


class WindowOutbox(nnx.Variable):
    """The host copies of a window step, on the optimizer from that step to ``mngr.step``.

    Its attribute name sorts after every other attribute: NNX flattens attributes in
    sorted order, and ``jit(donate_argnums=...)`` without out_shardings pairs donated inputs
    with the first outputs of the same shape/dtype, ignoring memory kinds. Flattened before
    ``opt_state``, a pinned-host copy would take the donated buffer of an Adam moment and
    XLA aborts. (Pass the model before the optimizer to the jitted step for the same reason.)
    """


def _pure(x):
    return nnx.as_pure(x)


def model_params(optimizer: "Optimizer", model: nnx.Module):
    """The pure (array) state of ``model`` that ``optimizer`` updates."""
    return _pure(nnx.state(model, optimizer.wrt, graph=optimizer.graph))


def model_rest(optimizer: "Optimizer", model: nnx.Module):
    """The pure state of ``model`` that is not updated by the optimizer (batch stats...)."""
    return _pure(nnx.state(model, nnx.Not(optimizer.wrt), graph=optimizer.graph))


def nnx_extras(optimizer: "Optimizer", model: nnx.Module, *, raw: bool = False) -> dict[str, Any]:
    """Extras of a checkpoint: the step counter and the non-optimized model state (typed
    PRNG keys of ``nnx.Rngs`` as key data, unless ``raw``)."""
    # get_value(), not [...] (the same array): an optimizer moved onto a compile-only target
    # holds ShapeDtypeStructs (overlap_ckpt.aot.placement), which do not index.
    extras = {"step": optimizer.step.get_value()}
    rest = model_rest(optimizer, model)
    if jax.tree.leaves(rest):
        extras["model_state"] = rest if raw else keys_as_data(rest)
    return extras


def to_plain(tree: Any) -> Any:
    """Replace every ``nnx.State`` in ``tree`` by a plain dict (leaves untouched)."""
    if isinstance(tree, (nnx.State, dict)):
        return {k: to_plain(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(to_plain(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_plain(v) for v in tree)
    return tree


def from_plain(plain: Any, like: Any) -> Any:
    """Inverse of :func:`to_plain`: put the leaves of ``plain`` back into the structure of
    ``like`` (which holds ``nnx.State`` nodes), matching leaves by position in ``to_plain``."""
    leaves, treedef = jax.tree.flatten(like)
    order = jax.tree.leaves(to_plain(jax.tree.unflatten(treedef, list(range(len(leaves))))))
    values = jax.tree.leaves(plain)
    if len(values) != len(leaves):
        raise ValueError(f"restored tree has {len(values)} leaves, the target {len(leaves)}")
    out: list[Any] = [None] * len(leaves)
    for position, value in zip(order, values):
        out[position] = value
    return jax.tree.unflatten(treedef, out)


class Optimizer(nnx.Optimizer):
    """``nnx.Optimizer`` plus overlapped-checkpoint capture in :meth:`update`.

    Outside checkpoint windows (and when never given to a manager) it is ``nnx.Optimizer``;
    its state is ``nnx.Optimizer``'s at every step.
    """

    def update(self, model: nnx.Module, grads: Any = _NO_GRADS, /, **kwargs):
        if grads is _NO_GRADS:  # nnx.Optimizer says why too (its check is private to Flax)
            raise TypeError(
                "overlap_ckpt.nnx.Optimizer.update(model, grads) takes the model and the gradients, "
                "as nnx.Optimizer.update does since Flax 0.11; update(grads) is the older API.")
        if _OUTBOX in vars(self):
            refuse_stale_outbox("the optimizer given to update")
        ticket = ticket_for(self.tx)
        checks_args = bool(kwargs) and (ticket is not None or is_planned(self.tx))
        if ticket is None and not checks_args:
            return super().update(model, grads, **kwargs)
        params, opt_state = model_params(self, model), _pure(self.opt_state)
        grad_arrays = _pure(nnx.state(grads, self.wrt, graph=self.graph))
        if checks_args:
            # At the first step that passes them once a manager plans this optimizer, window
            # or not: arguments that change the update are refused before any window; the
            # others are dropped in windows, where the update runs as the host replays it
            # (core.extra_args). An optimizer no open manager plans stays nnx.Optimizer.
            check_extra_update_args(self.tx, grad_arrays, opt_state, params, _pure(kwargs))
        if ticket is None:
            return super().update(model, grads, **kwargs)
        # Extras are not captured here: the forward pass already changed the model's other
        # state; the door copies them before the step (capture_before_step).
        new_params, new_opt_state, outbox, updates = captured_update(
            self.tx, ticket, params, opt_state, grad_arrays, None, step=self.step[...])
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
        self.step[...] += 1
        setattr(self, _OUTBOX, WindowOutbox(outbox))
        return updates  # as nnx.Optimizer.update


def parts_of(optimizer: Optimizer, model: nnx.Module) -> Parts:
    return Parts(model_params(optimizer, model), _pure(optimizer.opt_state), nnx_extras(optimizer, model),
                 optimizer.tx)


def restore_objects(optimizer: Optimizer, model: nnx.Module, parts: Parts) -> None:
    """Put restored arrays into the model and optimizer, in place."""
    nnx.update(model, parts.params)
    if "model_state" in parts.extras:
        nnx.update(model, keys_like(parts.extras["model_state"], model_rest(optimizer, model)))
    nnx.update(optimizer.opt_state, nnx.state(parts.opt_state, graph=optimizer.graph))
    optimizer.step[...] = parts.extras["step"]
    take_outbox_of(optimizer)


def take_outbox_of(optimizer: Optimizer) -> Outbox | None:
    """Remove the outbox of the last window step from ``optimizer`` and return it."""
    if _OUTBOX not in vars(optimizer):
        return None
    outbox = getattr(optimizer, _OUTBOX).get_value()
    delattr(optimizer, _OUTBOX)
    return outbox


class _PlainTrees:
    """NNX parts hold ``nnx.State`` nodes; checkpoints hold plain dicts. The model's other
    state changes in the forward pass, before ``update``: extras are taken before the step."""

    extras_in_step = False

    def plain(self, tree: Any) -> Any:
        return to_plain(tree)

    def unplain(self, tree: Any, like: Any) -> Any:
        return from_plain(tree, like)


def restore_target_of(optimizer: Optimizer, model: nnx.Module) -> Parts:
    return abstract_parts(Parts(model_params(optimizer, model), _pure(optimizer.opt_state),
                                nnx_extras(optimizer, model, raw=True), optimizer.tx))


class NnxDoor(_PlainTrees):
    """The door of :class:`Optimizer` used with ``nnx.jit``: the optimizer is the state."""

    name = "nnx"
    outbox_memory: str | None = backend.HOST_MEMORY

    def __init__(self, model: nnx.Module):
        self.model = model

    def parts(self, optimizer: Optimizer) -> Parts:
        return parts_of(optimizer, self.model)

    def step_number(self, optimizer: Optimizer) -> int:
        return int(optimizer.step[...])

    def prepared(self, optimizer: Optimizer) -> Optimizer:
        """Arrays committed in place (see :func:`committed`)."""
        like = next(iter(jax.tree.leaves(model_params(optimizer, self.model))), None)
        for obj in (self.model, optimizer):
            nnx.update(obj, committed(nnx.state(obj), like))
        return optimizer

    def is_state(self, x: Any) -> bool:
        return isinstance(x, Optimizer)

    def take_outbox(self, optimizer: Optimizer) -> tuple[Outbox | None, Optimizer]:
        return take_outbox_of(optimizer), optimizer

    def snapshot(self, optimizer: Optimizer) -> Parts:
        return host_copy(self.parts(optimizer))

    def restore_target(self, optimizer: Optimizer) -> Parts:
        return restore_target_of(optimizer, self.model)

    def restored(self, optimizer: Optimizer, parts: Parts) -> Optimizer:
        restore_objects(optimizer, self.model, parts)
        return optimizer


class NnxStateDoor(_PlainTrees):
    """The functional NNX style: the loop carries the ``nnx.State`` of ``(model, optimizer,
    ...)`` and a graphdef split once. A window step's state holds the optimizer's outbox
    variable, under the optimizer's key."""

    name = "nnx-functional"
    outbox_memory: str | None = backend.HOST_MEMORY

    def __init__(self, graphdef: Any, state: nnx.State):
        self.graphdef = graphdef
        self.optimizer_key = _optimizer_key(nnx.merge(graphdef, state))
        self.structure = jax.tree.structure(state)

    def objects(self, state: nnx.State) -> tuple[Optimizer, nnx.Module]:
        """The optimizer and its model, merged from ``state`` (no copies of arrays)."""
        return _optimizer_and_model(nnx.merge(self.graphdef, state))

    def parts(self, state: nnx.State) -> Parts:
        return parts_of(*self.objects(state))

    def step_number(self, state: nnx.State) -> int:
        return int(self.objects(state)[0].step[...])

    def prepared(self, state: nnx.State) -> nnx.State:
        optimizer, model = self.objects(state)
        return committed(state, next(iter(jax.tree.leaves(model_params(optimizer, model))), None))

    def is_state(self, x: Any) -> bool:
        return isinstance(x, nnx.State) and jax.tree.structure(x) == self.structure

    def take_outbox(self, state: nnx.State) -> tuple[Outbox | None, nnx.State]:
        node = state if self.optimizer_key is None else state[self.optimizer_key]
        if _OUTBOX not in node:
            return None, state
        outbox = node[_OUTBOX].get_value()
        del node[_OUTBOX]
        return outbox, state

    def snapshot(self, state: nnx.State) -> Parts:
        return host_copy(self.parts(state))

    def restore_target(self, state: nnx.State) -> Parts:
        return restore_target_of(*self.objects(state))

    def restored(self, state: nnx.State, parts: Parts) -> nnx.State:
        objects = nnx.merge(self.graphdef, state)
        restore_objects(*_optimizer_and_model(objects), parts)
        return nnx.state(objects)


def _items(objects: Any) -> list[tuple[Any, Any]]:
    """``(key in the state, object)`` of what was split together (key None: one object)."""
    if isinstance(objects, (tuple, list)):
        return list(enumerate(objects))
    if isinstance(objects, dict):
        return list(objects.items())
    return [(None, objects)]


def _optimizer_key(objects: Any) -> Any:
    """Where the optimizer's state is in the state of ``objects`` (see :func:`_items`)."""
    _optimizer_and_model(objects)  # exactly one of each, or a clear error
    return next(key for key, o in _items(objects) if isinstance(o, Optimizer))


def _optimizer_and_model(objects: Any) -> tuple[Optimizer, nnx.Module]:
    items = [o for _, o in _items(objects)]
    optimizers = [o for o in items if isinstance(o, Optimizer)]
    models = [o for o in items if isinstance(o, nnx.Module) and not isinstance(o, (nnx.Optimizer, nnx.Metric))]
    if len(optimizers) != 1 or len(models) != 1:
        raise TypeError(
            "the functional NNX style needs the state of exactly one model and one "
            f"overlap_ckpt.nnx.Optimizer, split together (found {len(models)} model(s) and "
            f"{len(optimizers)} optimizer(s)): `graphdef, state = nnx.split((model, optimizer))` "
            "(metrics may be split with them).")
    return optimizers[0], models[0]
