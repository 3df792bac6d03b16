"""Flax NNX integration: an ``nnx.Optimizer`` whose ``update`` captures checkpoint windows.

Usage (the current NNX API, ``update(model, grads)``)::

    from overlap_ckpt.nnx_optimizer import Optimizer
    from overlap_ckpt.manager import CheckpointManager

    model = MyModel(rngs=nnx.Rngs(0))
    optimizer = Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))          # donation is optional
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    with CheckpointManager("/ckpt", save_interval_steps=1000) as mngr:
        mngr.prepare(optimizer, model)       # or mngr.restore(target_state=optimizer, model=model)
        for batch in data:
            train_step(model, optimizer, batch)
            mngr.step(optimizer)             # one call per step, never blocks

``ckpt_plan`` and ``ckpt_phase`` are plain (static) Python attributes, so they are part of
the graph definition ``nnx.jit`` keys its cache on: the step compiles once per window phase.
The outbox of pinned-host copies is stored as ``nnx.data`` in ``ckpt_outbox`` by the jitted
update and taken by :meth:`CheckpointManager.step`.

What is saved (plain nested dicts, readable by stock Orbax)::

    {"step": optimizer.step, "params": <wrt state of the model>, "opt_state": <optax state>,
     "model_state": <the rest of the model's state, e.g. BatchStat; omitted when empty>}
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from .capture import capture_update


def _pure(x):
    return nnx.as_pure(x)


def model_params(optimizer: "Optimizer", model: nnx.Module):
    """The pure (array) state of ``model`` that ``optimizer`` updates."""
    return _pure(nnx.state(model, optimizer.wrt, graph=optimizer.graph))


def model_rest(optimizer: "Optimizer", model: nnx.Module):
    """The pure state of ``model`` that is not updated by the optimizer (batch stats...)."""
    return _pure(nnx.state(model, nnx.Not(optimizer.wrt), graph=optimizer.graph))


def nnx_extras(optimizer: "Optimizer", model: nnx.Module) -> dict[str, Any]:
    """Extras of a checkpoint: the step counter and the non-optimized model state."""
    extras = {"step": optimizer.step[...]}
    rest = model_rest(optimizer, model)
    if jax.tree.leaves(rest):
        extras["model_state"] = rest
    return extras


def to_plain(tree: Any) -> Any:
    """Replace every ``nnx.State`` in ``tree`` by a plain dict (leaves untouched)."""
    if isinstance(tree, nnx.State):
        return {k: to_plain(v) for k, v in tree.items()}
    if isinstance(tree, dict):
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

    Without a plan (never given to a manager) it behaves exactly like ``nnx.Optimizer``.
    """

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, wrt, graph: bool | None = None):
        super().__init__(model, tx, wrt=wrt, graph=graph)
        self.ckpt_plan = None
        self.ckpt_phase = None
        self.ckpt_outbox = None

    # The outbox is stored under a name that sorts after every other attribute: NNX flattens
    # attributes in sorted order, and ``jit(donate_argnums=...)`` without out_shardings pairs
    # donated inputs with the first outputs of the same shape/dtype, ignoring memory kinds.
    # Flattened before ``opt_state``, a pinned-host outbox copy would take the donated buffer
    # of an Adam moment and XLA aborts. (Pass the model before the optimizer to the jitted
    # step for the same reason.)
    @property
    def ckpt_outbox(self):
        return self.zz_ckpt_outbox

    @ckpt_outbox.setter
    def ckpt_outbox(self, value):
        self.zz_ckpt_outbox = nnx.data(value)

    def update(self, model: nnx.Module, grads, /, **kwargs):
        if self.ckpt_plan is None:
            self.ckpt_outbox = None
            return super().update(model, grads, **kwargs)
        if kwargs:
            raise NotImplementedError(
                "overlap_ckpt.nnx_optimizer.Optimizer.update does not pass extra arguments "
                "to the optax transformation yet.")
        params = model_params(self, model)
        grad_arrays = _pure(nnx.state(grads, self.wrt, graph=self.graph))
        opt_state = _pure(self.opt_state)
        extras = nnx_extras(self, model)
        new_params, new_opt_state, outbox = capture_update(
            self.ckpt_plan, self.ckpt_phase, params, opt_state, grad_arrays, extras,
            step=self.step[...])
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_opt_state, graph=self.graph))
        self.step[...] += 1
        self.ckpt_outbox = outbox
        return None
