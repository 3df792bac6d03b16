"""Users' own steps for ``tests/aot/test_user_step_report.py``, as a user writes them on this
machine: concrete state, FSDP-style ``NamedSharding``s over a ('data', 'fsdp') mesh of this
process's devices, the step jitted with the state's shardings and donating it.

Small MLPs, not the benchmark LMs: a report compiles the plain step, the user's step and
every window phase, and a tiny LM's program takes seconds per compile for a TPU or an H100.

Also ``overlap-ckpt aot --step tests/aot/user_steps.py:linen_fsdp`` (no arguments: the
functions build everything themselves), so only absolute imports here.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import overlap_ckpt as oc
from overlap_ckpt.aot import UserStep
from overlap_ckpt.core.window_context import window_tickets

IN, HIDDEN, OUT, BATCH = 64, 256, 16, 8


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "fsdp"))


def spec(x) -> PartitionSpec:
    """FSDP: a matrix split on its rows over 'fsdp', everything else replicated."""
    return PartitionSpec("fsdp") if jnp.ndim(x) == 2 else PartitionSpec()


class MLP(nn.Module):
    hidden: int = HIDDEN

    @nn.compact
    def __call__(self, x):
        return nn.Dense(OUT, name="out")(nn.relu(nn.Dense(self.hidden, name="hidden")(x)))


class DeepMLP(nn.Module):
    """Wide layers and little compute around them: many host copies over 1 MiB per step."""
    depth: int
    width: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.relu(nn.Dense(self.width, name=f"layer{i}")(x))
        return nn.Dense(OUT, name="out")(x)


def linen_state(state_class=oc.TrainState, hidden: int = HIDDEN, inputs: int = IN, model: nn.Module | None = None):
    model = MLP(hidden) if model is None else model
    params = model.init(jax.random.key(0), jnp.ones((1, inputs)))["params"]
    state = state_class.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    state = state.replace(step=jnp.asarray(0, jnp.int32))
    shardings = jax.tree.map(lambda x: NamedSharding(mesh(), spec(x)), state)
    return jax.device_put(state, shardings), shardings


def batch(inputs: int = IN, size: int = BATCH):
    rows = NamedSharding(mesh(), PartitionSpec("data"))
    return jax.device_put(jnp.ones((size, inputs)), rows), jax.device_put(jnp.zeros((size, OUT)), rows), rows


def train_step(state, x, y):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def jitted(shardings, rows):
    """The step jitted with the state's shardings, as docs/porting.md writes it."""
    return jax.jit(train_step, in_shardings=(shardings, rows, rows), out_shardings=shardings, donate_argnums=0)


def linen_fsdp() -> UserStep:
    """A Linen ``overlap_ckpt.TrainState`` (adamw), FSDP-sharded, its step jitted with explicit shardings."""
    state, shardings = linen_state()
    x, y, rows = batch()
    return UserStep(jitted(shardings, rows), (state, x, y))


def flax_reference(shardings_on, x_abstract, y_abstract):
    """The same step on Flax's own ``TrainState``, its arguments placed on a target's mesh by
    hand (``shardings_on(spec)``): the user's program compiled without overlap_ckpt."""
    state, _ = linen_state(train_state.TrainState)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shardings_on(spec(a))), state)
    step = jax.jit(train_step, in_shardings=jax.tree.map(lambda a: a.sharding, (abstract, x_abstract, y_abstract)),
                   out_shardings=jax.tree.map(lambda a: a.sharding, abstract), donate_argnums=0)
    return step.lower(abstract, x_abstract, y_abstract)


def linen_keeping_a_leaf_in_windows() -> UserStep:
    """A step that, in window steps only, also returns the donated hidden kernel (2 MiB): XLA
    must then copy that leaf within device memory, which the window's check names."""
    state, shardings = linen_state(hidden=1024, inputs=512)
    x, y, rows = batch(512)

    def step(state, x, y):
        kept = state.params["hidden"]["kernel"] if window_tickets() else None
        return train_step(state, x, y), kept

    return UserStep(jax.jit(step, in_shardings=(shardings, rows, rows), donate_argnums=0), (state, x, y))


def linen_deep(depth: int = 4, width: int = 1280, size: int = 2048) -> UserStep:
    """Four 1280-wide layers, FSDP: 1.6 MiB of each kernel and each of its two moments per
    device of a v5e:2x2, 13 host copies in a K=1 window, more than XLA:TPU keeps in flight
    over a step this short (7 of them serialized at K=1)."""
    state, shardings = linen_state(inputs=width, model=DeepMLP(depth, width))
    x, y, rows = batch(width, size)
    return UserStep(jitted(shardings, rows), (state, x, y))


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def nnx_objects(optimizer_class=oc.nnx.Optimizer):
    model = NnxMLP(nnx.Rngs(0))
    optimizer = optimizer_class(model, optax.adam(1e-3), wrt=nnx.Param)
    for obj in (model, optimizer):
        state = nnx.state(obj)
        nnx.update(obj, jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh(), spec(x))), state))
    return model, optimizer


@nnx.jit(donate_argnums=(0, 1))
def nnx_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def nnx_fsdp() -> UserStep:
    """An ``overlap_ckpt.nnx.Optimizer`` with ``nnx.jit``; the door needs the model."""
    model, optimizer = nnx_objects()
    x, y, _ = batch()
    return UserStep(nnx_train_step, (model, optimizer, x, y), model=model)
