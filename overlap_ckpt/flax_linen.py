"""Flax Linen integration: a drop-in ``TrainState`` whose ``apply_gradients`` captures
checkpoint windows inside the user's jitted step.

Usage (the user's step is unchanged apart from the class of the state)::

    from overlap_ckpt.flax_linen import TrainState
    from overlap_ckpt.manager import CheckpointManager

    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        grads = jax.grad(loss)(state.params, batch)
        return state.apply_gradients(grads=grads)

    with CheckpointManager("/ckpt", save_interval_steps=1000) as mngr:
        state = mngr.prepare(state)          # or mngr.restore(target_state=state)
        for batch in data:
            state = train_step(state, batch)
            state = mngr.step(state)         # one call per step, never blocks

The checkpoint plan and window phase are *static* fields (``pytree_node=False``): they are
part of the state's tree structure, so ``jax.jit`` compiles one variant of the step per
window phase (K+1 variants) and reuses them. The outbox of pinned-host copies rides in the
returned state (``ckpt_outbox``) until :meth:`CheckpointManager.step` takes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct
from flax.training import train_state

from .capture import capture_update

# Fields of the state that are not "extras" of the checkpoint (either captured as
# params/opt_state, static, or the checkpointer's own bookkeeping).
_NOT_EXTRAS = frozenset({"params", "opt_state", "apply_fn", "tx", "ckpt_plan", "ckpt_phase", "ckpt_outbox"})


def extra_field_names(state: Any) -> tuple[str, ...]:
    """Names of the pytree fields of ``state`` saved next to params/opt_state: ``step`` and
    every field a user subclass adds (``batch_stats``, a dropout key...), in declaration order."""
    names = []
    for f in dataclasses.fields(state):
        if f.name in _NOT_EXTRAS or not f.metadata.get("pytree_node", True):
            continue
        names.append(f.name)
    return tuple(names)


def state_extras(state: Any) -> dict[str, Any]:
    """``{name: value}`` of the extra fields of ``state`` (see :func:`extra_field_names`)."""
    return {name: getattr(state, name) for name in extra_field_names(state)}


class TrainState(train_state.TrainState, kw_only=True):
    """``flax.training.train_state.TrainState`` plus overlapped-checkpoint capture.

    Extra fields (all keyword-only, so subclasses may add positional fields):

    * ``ckpt_plan`` (static): the :class:`~overlap_ckpt.plan.CapturePlan`, set by the manager;
    * ``ckpt_phase`` (static): the window phase of the step that takes this state as input,
      or ``None`` outside a window;
    * ``ckpt_outbox`` (pytree): the pinned-host copies the last step captured, or ``None``.

    A state with no plan (never given to a manager) behaves exactly like Flax's.
    """

    ckpt_plan: Any = struct.field(pytree_node=False, default=None)
    ckpt_phase: int | None = struct.field(pytree_node=False, default=None)
    ckpt_outbox: Any = None

    def __init_subclass__(cls, **kwargs):
        # Like flax.struct.PyTreeNode, but the outbox flattens after every other field
        # (see _register_outbox_last).
        _register_outbox_last(cls, **kwargs)

    def apply_gradients(self, *, grads, **kwargs):
        """Like Flax's: ``step + 1``, params/opt_state updated by ``tx``, ``**kwargs`` replaced.

        With a plan attached, the update goes through :func:`capture_update`, and in a
        window phase the step's outbox is returned in ``ckpt_outbox``. The extras saved with
        the checkpoint are this (input) state's ``step`` and user fields, i.e. the ones of
        the version being checkpointed, not the ``**kwargs`` replacing them.
        """
        if self.ckpt_plan is None:
            return super().apply_gradients(grads=grads, **kwargs).replace(ckpt_outbox=None)
        if train_state.OVERWRITE_WITH_GRADIENT in grads:
            raise NotImplementedError(
                "overlap_ckpt.TrainState does not support the overwrite-with-gradient "
                f"collection ({train_state.OVERWRITE_WITH_GRADIENT!r}) yet.")
        new_params, new_opt_state, outbox = capture_update(
            self.ckpt_plan, self.ckpt_phase, self.params, self.opt_state, grads,
            state_extras(self), step=self.step)
        return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state,
                            ckpt_outbox=outbox, **kwargs)


def _register_outbox_last(cls, **kwargs):
    """``flax.struct.dataclass`` for subclasses of :class:`TrainState`, with ``ckpt_outbox``
    flattened *last*.

    Why: ``jax.jit(donate_argnums=...)`` without ``out_shardings`` pairs each donated input
    with the first output of the same shape and dtype, ignoring memory kinds. The outbox
    holds pinned-host copies of state leaves; if it flattened before a user field of the same
    shape (a scalar ``loss_sum``...), the donated device buffer would be aliased to a
    pinned-host output and XLA aborts ("PjRtBuffer's memory kind does not match"). With the
    outbox last, every donated leaf pairs with its own updated state leaf first.
    """
    from flax import serialization

    if "_flax_dataclass" in cls.__dict__:
        return cls
    kwargs.setdefault("frozen", True)
    data_clz = dataclasses.dataclass(**kwargs)(cls)
    data_fields, meta_fields = [], []
    for f in dataclasses.fields(data_clz):
        (data_fields if f.metadata.get("pytree_node", True) else meta_fields).append(f.name)
    if "ckpt_outbox" in data_fields:
        data_fields.remove("ckpt_outbox")
        data_fields.append("ckpt_outbox")

    def replace(self, **updates):
        return dataclasses.replace(self, **updates)

    data_clz.replace = replace
    jax.tree_util.register_dataclass(data_clz, data_fields, meta_fields)

    def to_state_dict(x):
        return {name: serialization.to_state_dict(getattr(x, name)) for name in data_fields}

    def from_state_dict(x, state):
        state = dict(state)
        updates = {}
        for name in data_fields:
            if name not in state:
                raise ValueError(f"Missing field {name} in state dict while restoring an instance "
                                 f"of {cls.__name__}")
            updates[name] = serialization.from_state_dict(getattr(x, name), state.pop(name), name=name)
        if state:
            raise ValueError(f"Unknown field(s) {sorted(state)} in state dict while restoring an "
                             f"instance of {cls.__name__}")
        return x.replace(**updates)

    serialization.register_serialization_state(data_clz, to_state_dict, from_state_dict)
    data_clz._flax_dataclass = True
    return data_clz


def is_plain_flax_train_state(state: Any) -> bool:
    """True for a Flax ``TrainState`` (or subclass) that is not an overlap_ckpt one."""
    return isinstance(state, train_state.TrainState) and not isinstance(state, TrainState)


def with_step_array(state: Any) -> Any:
    """``state`` with ``step`` as an int32 device array (``TrainState.create`` leaves a
    Python ``0``, which would make the first step compile a variant of its own and be
    saved with a platform-dependent dtype)."""
    step = state.step
    if isinstance(step, jax.Array):
        return state
    return state.replace(step=jax.numpy.asarray(step, dtype=jax.numpy.int32))
