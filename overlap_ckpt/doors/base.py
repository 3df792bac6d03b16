"""The door protocol: what the manager needs from a training-loop style.

A *state* is whatever the user's loop passes from step to step (a Linen ``TrainState``,
an NNX ``Optimizer``, an ``nnx.State``...). A door turns it into the three trees the engine
plans and saves and takes a window step's outbox back. (Whether a step is in a window
does not go through the door: the manager sets the window context,
:mod:`overlap_ckpt.core.window_context`, which the door's update reads at trace time.)

* ``parts(state)``: :class:`Parts` (params, opt_state, extras and the optax transformation);
* ``step_number(state)`` / ``prepared(state)``: the state's step (read once, at prepare),
  and the state as the first step should get it (arrays committed, see :func:`committed`);
* ``extras_in_step``: whether the update in the step still sees the extras of its input
  version (Linen); if not (NNX, whose forward pass updates batch statistics and RNG counts),
  the manager copies them just before the last step of a window;
* ``take_outbox(state)``: the outbox a window step produced (None: the step did not
  capture) and the state without it, as the Flax class would hold it. The outbox must
  flatten *last* in the step's outputs, so that ``jit(donate_argnums=...)`` pairs every
  donated leaf with its own updated leaf before any host-memory output of the same shape;
* ``is_state(x)``: recognise the state among a step's arguments (``compile_ahead``);
* ``snapshot(state)``: host copies of the parts, owning their memory (a synchronous save);
* ``restore_target(state)`` / ``restored(state, parts)``: the shapes, dtypes and shardings
  a restore reads into, and ``state`` with the restored arrays put back;
* ``plain(tree)`` / ``unplain(tree, like)``: the tree as saved (plain dicts, lists and
  arrays, what stock Orbax returns) and back to the door's own node types.

The saved tree of every door is ``{"step", "params", "opt_state", **extras}``; an app may
rearrange it (``CheckpointManager(save_tree=...)``), see :mod:`overlap_ckpt.layouts`.
"""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType
from typing import Any, Callable, Protocol

import jax
import optax

from ..core.ticket import Outbox
from ..hostarray import HostArray, is_prng_key


@dataclasses.dataclass(frozen=True)
class Parts:
    """The trees of a train state that a checkpoint holds, and the optimizer it is trained with."""

    params: Any
    opt_state: Any
    extras: dict[str, Any]  # "step" and every other saved field, by name
    tx: optax.GradientTransformation

    def map(self, fn: Callable[..., Any], *others: "Parts") -> "Parts":
        """``fn`` applied to every leaf of the three trees (with the matching leaves of
        ``others``, trees of the same structure); the optimizer stays."""
        return Parts(*(jax.tree.map(fn, getattr(self, name), *(getattr(o, name) for o in others))
                       for name in ("params", "opt_state", "extras")), self.tx)


class Door(Protocol):
    name: str  # recorded in the checkpoint's metadata ("linen", "nnx", "nnx-functional", "pmap")
    outbox_memory: str | None  # where window steps put their copies (None: device, for pmap)
    extras_in_step: bool  # False: the step changes extras before the update (copied before it)

    def parts(self, state: Any) -> Parts: ...

    def step_number(self, state: Any) -> int: ...

    def prepared(self, state: Any) -> Any: ...

    def take_outbox(self, state: Any) -> tuple[Outbox | None, Any]: ...

    def is_state(self, x: Any) -> bool: ...

    def snapshot(self, state: Any) -> Parts: ...

    def restore_target(self, state: Any) -> Parts: ...

    def restored(self, state: Any, parts: Parts) -> Any: ...

    def plain(self, tree: Any) -> Any: ...

    def unplain(self, tree: Any, like: Any) -> Any: ...


def standard_tree(parts: Parts) -> dict:
    """The saved tree: ``{"step", "params", "opt_state", **extras}``."""
    return {"params": parts.params, "opt_state": parts.opt_state, **parts.extras}


def committed(tree: Any, like: Any = None) -> Any:
    """Every array of ``tree`` committed to its devices.

    A freshly initialised state holds *uncommitted* arrays, while a window step returns
    arrays committed to their devices (its host-memory outputs pin the placement). Jit keys
    its cache on that difference, so without this the first plain step after a window would
    compile the train step once more. An uncommitted array on other devices than ``like``
    (the params, e.g. on a mesh) goes to ``like``'s devices, replicated: committing a fresh
    step counter to device 0 next to mesh-sharded params would make the step unrunnable.
    """
    target = None
    if isinstance(like, jax.Array):
        sharding = like.sharding
        target = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
                  if isinstance(sharding, jax.sharding.NamedSharding) else sharding)

    def put(x):
        if not isinstance(x, jax.Array) or x.committed:
            return x
        if target is not None and x.sharding.device_set != target.device_set:
            return jax.device_put(x, target)
        return jax.device_put(x, x.sharding)
    return jax.tree.map(put, tree)


def abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
    """Shape, dtype and sharding of ``x`` as a restore target, from metadata only (the
    buffer may be donated already); a typed PRNG key as its key data, as it is saved; a
    Python number as the array a step would make of it."""
    if is_prng_key(x):
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
    if not isinstance(x, jax.Array):
        x = jax.numpy.asarray(x, dtype=jax.numpy.int32 if isinstance(x, int) else None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def abstract_parts(parts: Parts) -> Parts:
    return parts.map(abstract_leaf)


def host_copy(parts: Parts) -> Parts:
    """Host copies of the parts' arrays that own their memory (a later step may donate the
    device buffers): what a synchronous save writes."""
    return parts.map(lambda x: HostArray.from_jax(x, copy=True) if isinstance(x, jax.Array) else x)


def keys_as_data(tree: Any) -> Any:
    """``tree`` with every typed PRNG key replaced by its raw ``uint32`` key data.

    A typed key (``jax.random.key``) has a dtype numpy and zarr cannot hold; its data can
    be saved and wrapped again on restore (:func:`keys_like`). Works on tracers too, so the
    jitted step and the plan see the same extras.
    """
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_prng_key(x) else x, tree)


def keys_like(tree: Any, like: Any) -> Any:
    """Inverse of :func:`keys_as_data`: wrap key data where ``like`` holds a typed key."""
    return jax.tree.map(lambda x, ref: jax.random.wrap_key_data(x, impl=jax.random.key_impl(ref))
                        if is_prng_key(ref) else x, tree, like)


def refuse_stale_outbox(where: str) -> None:
    """Raised at trace time when a state still holds the outbox of its window step."""
    raise TypeError(
        f"{where} carries the host copies of a checkpoint window step: after every training step, "
        "pass the state it returned to CheckpointManager.step(state) and train on what that returns.")


def imported_nnx() -> ModuleType | None:
    """``flax.nnx`` if this program has imported it, else None.

    Why: the doors tell NNX objects apart without importing NNX themselves (about 1 s, which
    a Linen or Orbax loop never needs); before a program imports NNX, no NNX object exists.
    """
    return sys.modules.get("flax.nnx")
