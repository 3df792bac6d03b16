"""Flax Linen door: a drop-in ``TrainState`` whose ``apply_gradients`` captures checkpoint
windows inside the user's jitted (or pmapped) step.

Usage (the user's step is unchanged apart from the class of the state)::

    state = overlap_ckpt.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        grads = jax.grad(loss)(state.params, batch)
        return state.apply_gradients(grads=grads)

    with overlap_ckpt.CheckpointManager("/ckpt", save_interval_steps=1000) as mngr:
        state = mngr.prepare(state)          # or mngr.restore(target_state=state)
        for batch in data:
            state = train_step(state, batch)
            state = mngr.step(state)         # one call per step, never blocks

The step learns that it is in a window from the manager's window context
(:mod:`overlap_ckpt.core.window_context`, part of jit's cache key), not from the state: the
state the loop holds is the one Flax's class would hold. The only trace of overlap_ckpt is
the field ``ckpt_outbox``, ``None`` except between a window step and the ``mngr.step`` that
takes its :class:`~overlap_ckpt.core.capture.Outbox` (host copies have to leave the jitted
step as outputs). It has no leaves when ``None``, Flax's ``to_state_dict`` /
``from_state_dict`` skip it, and a sharding tree built from any state the loop holds
(``ckpt_outbox=None``) is a valid ``in_shardings``/``out_shardings`` prefix of every variant.

Under ``jax.pmap`` (a replicated state, every leaf with a leading device axis) the door
plans on one replica and saves it unreplicated, as ``flax.jax_utils.unreplicate`` would.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax.training import train_state

from ..core import backend
from ..core.capture import capture_update
from ..core.ticket import Outbox
from ..core.window_context import ticket_for
from ..hostarray import HostArray
from .base import Parts, abstract_parts, committed, host_copy, keys_as_data, keys_like, refuse_stale_outbox

_OUTBOX = "ckpt_outbox"
# Fields that are not "extras" of the checkpoint (captured as params/opt_state, static,
# or the checkpointer's own outbox).
_NOT_EXTRAS = frozenset({"params", "opt_state", "apply_fn", "tx", _OUTBOX})


def extra_field_names(state: Any) -> tuple[str, ...]:
    """Names of the pytree fields of ``state`` saved next to params/opt_state: ``step`` and
    every field a user subclass adds (``batch_stats``, a dropout key...), in declaration order."""
    return tuple(f.name for f in dataclasses.fields(state)
                 if f.name not in _NOT_EXTRAS and f.metadata.get("pytree_node", True))


def raw_extras(state: Any) -> dict[str, Any]:
    """``{name: value}`` of the extra fields of ``state`` (see :func:`extra_field_names`)."""
    return {name: getattr(state, name) for name in extra_field_names(state)}


def state_extras(state: Any) -> dict[str, Any]:
    """The extras as saved: typed PRNG keys as key data."""
    return keys_as_data(raw_extras(state))


class TrainState(train_state.TrainState, kw_only=True):
    """``flax.training.train_state.TrainState`` plus overlapped-checkpoint capture.

    ``ckpt_outbox`` (keyword-only, so subclasses may add positional fields) carries a
    window step's host copies to ``mngr.step``, see the module docstring. A state never
    given to a manager behaves exactly like Flax's.
    """

    ckpt_outbox: Any = None

    def __init_subclass__(cls, **kwargs):
        # Like flax.struct.PyTreeNode, but the slot flattens after every other field
        # (see _register_slot_last).
        _register_slot_last(cls, **kwargs)

    def apply_gradients(self, *, grads, **kwargs):
        """Like Flax's: ``step + 1``, params/opt_state updated by ``tx``, ``**kwargs`` replaced.

        In a window step (a ticket in the window context, planned for this state's ``tx``)
        the update goes through :func:`capture_update` and the outbox comes back in
        ``ckpt_outbox``. The extras saved with the checkpoint are this (input) state's
        ``step`` and user fields, i.e. the ones of the version being checkpointed, not the
        ``**kwargs`` replacing them. Another ``TrainState`` updated in the same step (a
        second model with its own optimizer) is left alone.
        """
        if self.ckpt_outbox is not None:
            refuse_stale_outbox("the TrainState given to apply_gradients")
        ticket = ticket_for(self.tx)
        if ticket is None:
            return super().apply_gradients(grads=grads, **kwargs)
        new_params, new_opt_state, outbox = capture_update(
            self.tx, ticket, self.params, self.opt_state, grads, state_extras(self), step=self.step)
        return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state,
                            ckpt_outbox=outbox, **kwargs)


def _register_slot_last(cls, **kwargs):
    """``flax.struct.dataclass`` for subclasses of :class:`TrainState`, with ``ckpt_outbox``
    flattened *last* and left out of Flax's state dicts.

    Why: ``jax.jit(donate_argnums=...)`` without ``out_shardings`` pairs each donated input
    with the first output of the same shape and dtype, ignoring memory kinds. The outbox
    holds pinned-host copies of state leaves; if it flattened before a user field of the same
    shape (a scalar ``loss_sum``...), the donated device buffer would be aliased to a
    pinned-host output and XLA aborts ("PjRtBuffer's memory kind does not match"). With the
    slot last, every donated leaf pairs with its own updated state leaf first. The state
    dicts (``flax.serialization``) hold exactly the fields of Flax's ``TrainState`` and a
    subclass's own: code that moves state dicts between the two classes sees no difference.
    """
    if "_flax_dataclass" in cls.__dict__:
        return cls
    kwargs.setdefault("frozen", True)
    data_clz = dataclasses.dataclass(**kwargs)(cls)
    data_fields, meta_fields = [], []
    for f in dataclasses.fields(data_clz):
        (data_fields if f.metadata.get("pytree_node", True) else meta_fields).append(f.name)
    data_fields.remove(_OUTBOX)
    data_fields.append(_OUTBOX)
    saved_fields = data_fields[:-1]

    def replace(self, **updates):
        return dataclasses.replace(self, **updates)

    data_clz.replace = replace
    jax.tree_util.register_dataclass(data_clz, data_fields, meta_fields)

    _register_state_dict(data_clz, saved_fields)
    data_clz._flax_dataclass = True
    return data_clz


def _register_state_dict(cls, saved_fields: list[str]) -> None:
    """Flax state dicts of ``cls`` with the ``saved_fields`` only (not ``ckpt_outbox``)."""
    from flax import serialization

    def to_state_dict(x):
        return {name: serialization.to_state_dict(getattr(x, name)) for name in saved_fields}

    def from_state_dict(x, state):
        state = dict(state)
        updates = {}
        for name in saved_fields:
            if name not in state:
                raise ValueError(f"Missing field {name} in state dict while restoring an instance "
                                 f"of {cls.__name__}")
            updates[name] = serialization.from_state_dict(getattr(x, name), state.pop(name), name=name)
        if state:
            raise ValueError(f"Unknown field(s) {sorted(state)} in state dict while restoring an "
                             f"instance of {cls.__name__}")
        return x.replace(**updates)

    serialization.register_serialization_state(cls, to_state_dict, from_state_dict, override=True)


_register_state_dict(TrainState, [f.name for f in dataclasses.fields(TrainState)
                                   if f.name != _OUTBOX and f.metadata.get("pytree_node", True)])


def is_plain_flax_train_state(state: Any) -> bool:
    """True for a Flax ``TrainState`` (or subclass) that is not an overlap_ckpt one."""
    return isinstance(state, train_state.TrainState) and not isinstance(state, TrainState)


def is_replicated(state: TrainState) -> bool:
    """True for a state replicated for ``jax.pmap``: ``step`` (a scalar in a jitted loop)
    has one entry per local device."""
    step = state.step
    return (isinstance(step, jax.Array) and step.ndim == 1 and step.shape[0] == jax.local_device_count() > 1
            and len(step.sharding.device_set) == step.shape[0])


class LinenDoor:
    """The door of :class:`TrainState` in a jitted step."""

    name = "linen"
    outbox_memory: str | None = backend.HOST_MEMORY
    extras_in_step = True  # apply_gradients sees the input state's fields unchanged

    def parts(self, state: TrainState) -> Parts:
        return Parts(state.params, state.opt_state, state_extras(state), state.tx)

    def step_number(self, state: TrainState) -> int:
        return int(state.step)

    def prepared(self, state: TrainState) -> TrainState:
        """The state as the first step should get it: ``step`` an int32 device array (not
        ``create``'s Python 0, which would compile a variant of its own and save with a
        platform-dependent dtype), every array committed (see :func:`committed`).

        A weakly typed counter (``create`` run under ``jax.jit`` returns ``step`` as a weak
        int32, and ``step + 1`` keeps it weak) is made strong too, as a restore returns it:
        the step's program converts a weak input, and XLA fused the loss otherwise, so the
        first losses after a restore differed from the uninterrupted run's in the last bit."""
        step = state.step
        if not isinstance(step, jax.Array):
            state = state.replace(step=jax.numpy.asarray(step, dtype=jax.numpy.int32))
        elif step.weak_type:
            state = state.replace(step=step.astype(step.dtype))
        leaves = jax.tree.leaves(state.params)
        return committed(state, like=leaves[0] if leaves else None)

    def is_state(self, x: Any) -> bool:
        return isinstance(x, TrainState)

    def take_outbox(self, state: TrainState) -> tuple[Outbox | None, TrainState]:
        outbox = state.ckpt_outbox
        if outbox is None:
            return None, state
        return outbox, state.replace(ckpt_outbox=None)

    def snapshot(self, state: TrainState) -> Parts:
        return host_copy(self.parts(state))

    def plain(self, tree: Any) -> Any:
        return tree

    def unplain(self, tree: Any, like: Any) -> Any:
        return tree

    def restore_target(self, state: TrainState) -> Parts:
        """Shapes, dtypes and shardings the saved arrays are read into."""
        return abstract_parts(Parts(state.params, state.opt_state, raw_extras(state), state.tx))

    def restored(self, state: TrainState, parts: Parts) -> TrainState:
        extras = keys_like(parts.extras, raw_extras(state))
        return state.replace(params=parts.params, opt_state=parts.opt_state, ckpt_outbox=None, **extras)


class PmapDoor(LinenDoor):
    """:class:`TrainState` replicated for ``jax.pmap``.

    Inside ``pmap`` every device runs the same update on identical data (gradients reduced
    with ``lax.pmean`` over the axis name), so one replica is the state: the plan is made
    for one device's view, the window copies stay in device memory (``pmap`` outputs cannot
    be placed in host memory) and the door takes device 0's copy after the step. Saved
    arrays have no device axis, like ``flax.jax_utils.unreplicate(state)``; restore
    replicates them again. Per-device state that differs between replicas (unsynchronised
    batch statistics) is saved from device 0.
    """

    name = "pmap"
    outbox_memory = None

    def parts(self, state: TrainState) -> Parts:
        """One replica, as abstract arrays on device 0 (planned without touching data)."""
        device = jax.local_devices()[0]
        one = lambda x: jax.ShapeDtypeStruct(  # noqa: E731
            x.shape[1:], x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
        return abstract_parts(Parts(state.params, state.opt_state, raw_extras(state), state.tx)).map(one)

    def step_number(self, state: TrainState) -> int:
        return int(np.asarray(state.step.addressable_shards[0].data).reshape(-1)[0])

    def prepared(self, state: TrainState) -> TrainState:
        return state

    def take_outbox(self, state: TrainState) -> tuple[Outbox | None, TrainState]:
        outbox, state = super().take_outbox(state)
        if isinstance(outbox, Outbox):
            outbox = outbox.map(_first_replica)
        return outbox, state

    def snapshot(self, state: TrainState) -> Parts:
        return LinenDoor.parts(self, state).map(lambda x: HostArray.from_numpy(np.array(_first_replica(x))))

    def restore_target(self, state: TrainState) -> Parts:
        return self.parts(state)

    def restored(self, state: TrainState, parts: Parts) -> TrainState:
        return super().restored(state, parts.map(_replicate, LinenDoor.parts(self, state)))


def _replicate(x: jax.Array, like: jax.Array) -> jax.Array:
    """One replica per device, laid out like the replicated array ``like``."""
    one = jax.numpy.reshape(x, (1, *x.shape))
    per_device = [jax.device_put(one, d) for d in like.sharding.addressable_devices_indices_map(like.shape)]
    return jax.make_array_from_single_device_arrays(like.shape, like.sharding, per_device)


def _first_replica(x: jax.Array) -> jax.Array:
    """Device 0's copy of a pmap output, without its device axis (an array on device 0)."""
    data = x.addressable_shards[0].data
    return data.reshape(data.shape[1:])
