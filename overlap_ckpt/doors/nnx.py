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

The optimizer's slot is a variable of its own (:class:`WindowSlot`): ``None`` outside
windows (``update`` is then ``nnx.Optimizer.update``, nothing added), a
:class:`~overlap_ckpt.core.capture.WindowTicket` going into a window step, the step's
outbox coming out. Being a variable, it travels in the ``nnx.State`` (not in the graph
definition), which is what lets the functional style work with a graphdef split once.

What is saved (plain nested dicts, readable by stock Orbax)::

    {"step": optimizer.step, "params": <wrt state of the model>, "opt_state": <optax state>,
     "model_state": <the rest of the model's state, e.g. BatchStat; omitted when empty>}
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from ..core import backend
from ..core.capture import Outbox, WindowTicket, capture_update
from .base import Parts, abstract_parts, committed, host_copy, keys_as_data, keys_like, refuse_stale_outbox

_SLOT = "zz_ckpt_window"


class WindowSlot(nnx.Variable):
    """The optimizer's checkpoint slot (see the module docstring).

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
    extras = {"step": optimizer.step[...]}
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

    Outside checkpoint windows (and when never given to a manager) it is ``nnx.Optimizer``.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, wrt, graph: bool | None = None):
        super().__init__(model, tx, wrt=wrt, graph=graph)
        setattr(self, _SLOT, WindowSlot(None))

    @property
    def ckpt_window(self) -> Any:
        return getattr(self, _SLOT).get_value()

    @ckpt_window.setter
    def ckpt_window(self, value: Any) -> None:
        getattr(self, _SLOT).set_value(value)

    def update(self, model: nnx.Module, grads, /, **kwargs):
        ticket = self.ckpt_window
        if ticket is None:
            return super().update(model, grads, **kwargs)
        if isinstance(ticket, Outbox):
            refuse_stale_outbox("the optimizer given to update")
        if kwargs:
            raise NotImplementedError(
                "overlap_ckpt.nnx.Optimizer.update does not pass extra arguments to the optax "
                "transformation in checkpoint windows.")
        # Extras are not captured here: the forward pass already changed the model's other
        # state; the door copies them before the step (capture_before_step).
        new_params, new_opt_state, outbox = capture_update(
            self.tx, ticket, model_params(self, model), _pure(self.opt_state),
            _pure(nnx.state(grads, self.wrt, graph=self.graph)), None, step=self.step[...])
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
        self.step[...] += 1
        self.ckpt_window = outbox
        return None


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
    optimizer.ckpt_window = None


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

    def attach(self, optimizer: Optimizer, ticket: WindowTicket | None) -> Optimizer:
        optimizer.ckpt_window = ticket
        return optimizer

    def is_state(self, x: Any) -> bool:
        return False  # nnx.jit steps take objects: compile ahead in the functional style

    def copy_with(self, state: Any, ticket: WindowTicket) -> Any:
        raise NotImplementedError

    def take_outbox(self, optimizer: Optimizer) -> tuple[Outbox | None, Optimizer]:
        slot = optimizer.ckpt_window
        if slot is not None and not isinstance(slot, WindowTicket):
            optimizer.ckpt_window = None
        return slot, optimizer

    def snapshot(self, optimizer: Optimizer) -> Parts:
        return host_copy(self.parts(optimizer))

    def restore_target(self, optimizer: Optimizer) -> Parts:
        return restore_target_of(optimizer, self.model)

    def restored(self, optimizer: Optimizer, parts: Parts) -> Optimizer:
        restore_objects(optimizer, self.model, parts)
        return optimizer


class NnxStateDoor(_PlainTrees):
    """The functional NNX style: the loop carries the ``nnx.State`` of ``(model, optimizer,
    ...)`` and a graphdef split once. The slot is found in the state by its variable type."""

    name = "nnx-functional"
    outbox_memory: str | None = backend.HOST_MEMORY

    def __init__(self, graphdef: Any, state: nnx.State):
        self.graphdef = graphdef
        self.path = _slot_path(state)

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

    def _slot(self, state: nnx.State) -> WindowSlot:
        node = state
        for key in self.path:
            node = node[key]
        return node

    def attach(self, state: nnx.State, ticket: WindowTicket | None) -> nnx.State:
        self._slot(state).set_value(ticket)
        return state

    def is_state(self, x: Any) -> bool:
        return isinstance(x, nnx.State) and any(isinstance(v, WindowSlot) for _, v in nnx.to_flat_state(x))

    def copy_with(self, state: nnx.State, ticket: WindowTicket) -> nnx.State:
        copy = jax.tree.map(lambda x: x, state)  # new variables: the caller's state is untouched
        return self.attach(copy, ticket)

    def take_outbox(self, state: nnx.State) -> tuple[Outbox | None, nnx.State]:
        slot = self._slot(state)
        value = slot.get_value()
        if value is not None and not isinstance(value, WindowTicket):
            slot.set_value(None)
        return value, state

    def snapshot(self, state: nnx.State) -> Parts:
        return host_copy(self.parts(state))

    def restore_target(self, state: nnx.State) -> Parts:
        return restore_target_of(*self.objects(state))

    def restored(self, state: nnx.State, parts: Parts) -> nnx.State:
        objects = nnx.merge(self.graphdef, state)
        restore_objects(*_optimizer_and_model(objects), parts)
        return nnx.state(objects)


def _slot_path(state: nnx.State) -> tuple:
    paths = [path for path, value in nnx.to_flat_state(state) if isinstance(value, WindowSlot)]
    if len(paths) != 1:
        raise TypeError(
            f"the nnx.State given to the CheckpointManager holds {len(paths)} overlap_ckpt.nnx.Optimizer "
            "slots; split exactly one overlap_ckpt.nnx.Optimizer with its model, e.g. "
            "`graphdef, state = nnx.split((model, optimizer))`.")
    return tuple(paths[0])


def _optimizer_and_model(objects: Any) -> tuple[Optimizer, nnx.Module]:
    items = list(objects) if isinstance(objects, (tuple, list)) else (
        list(objects.values()) if isinstance(objects, dict) else [objects])
    optimizers = [o for o in items if isinstance(o, Optimizer)]
    models = [o for o in items if isinstance(o, nnx.Module) and not isinstance(o, (nnx.Optimizer, nnx.Metric))]
    if len(optimizers) != 1 or len(models) != 1:
        raise TypeError(
            "the functional NNX style needs the state of exactly one model and one "
            f"overlap_ckpt.nnx.Optimizer, split together (found {len(models)} model(s) and "
            f"{len(optimizers)} optimizer(s)): `graphdef, state = nnx.split((model, optimizer))` "
            "(metrics may be split with them).")
    return optimizers[0], models[0]
