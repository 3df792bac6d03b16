"""Which door serves a given train state; the one place that names the supported styles.

A new framework is one door module plus one branch here. States that look like a
supported one but cannot capture (a plain Flax ``TrainState``, a plain ``nnx.Optimizer``)
are refused with what to use instead.
"""

from __future__ import annotations

from typing import Any

from .base import Door, imported_nnx


def door_for(state: Any, *, model: Any = None, graphdef: Any = None) -> Door:
    """The door for ``state``; ``model`` (NNX with ``nnx.jit``) and ``graphdef`` (NNX in the
    functional style) complete what the state alone does not say."""
    from . import linen

    if isinstance(state, linen.TrainState):
        if linen.is_replicated(state):
            return linen.PmapDoor()
        return linen.LinenDoor()
    if linen.is_plain_flax_train_state(state):
        raise TypeError(
            f"CheckpointManager got a {type(state).__module__}.{type(state).__qualname__}, a plain "
            "flax.training.train_state.TrainState: its apply_gradients cannot capture checkpoint "
            "windows. Use overlap_ckpt.TrainState instead: it is a drop-in subclass, e.g. "
            "`state = overlap_ckpt.TrainState.create(apply_fn=..., params=..., tx=...)`, and "
            "subclass it instead of Flax's for extra fields.")
    nnx_door = _nnx_door(state, model, graphdef)
    if nnx_door is not None:
        return nnx_door
    raise TypeError(f"CheckpointManager needs an overlap_ckpt.TrainState, an overlap_ckpt.nnx.Optimizer "
                    f"or the nnx.State of one, got {type(state).__name__}.")


def _nnx_door(state: Any, model: Any, graphdef: Any) -> Door | None:
    nnx = imported_nnx()
    if nnx is None:  # no NNX object can exist
        return None
    from . import nnx as nnx_door

    if isinstance(state, nnx_door.Optimizer):
        if model is None:
            raise TypeError("prepare(optimizer, model): the NNX door needs the model the optimizer updates.")
        return nnx_door.NnxDoor(model)
    if isinstance(state, nnx.Optimizer):
        raise TypeError(
            "CheckpointManager got a plain flax.nnx.Optimizer: its update() cannot capture "
            "checkpoint windows. Use overlap_ckpt.nnx.Optimizer(model, tx, wrt=...) instead "
            "(a drop-in subclass).")
    if isinstance(state, nnx.State):
        if graphdef is None:
            raise TypeError("prepare(state, graphdef=graphdef): the functional NNX style needs the "
                            "graphdef the state was split with.")
        return nnx_door.NnxStateDoor(graphdef, state)
    return None
