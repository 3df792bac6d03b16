"""Shared by the setups: the README's Linen model, state and jitted step (tiny, CPU)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import overlap_ckpt as oc

model = nn.Dense(3)
x, y = jnp.ones((8, 4)), jnp.zeros((8, 3))
batch = (x, y)
params = model.init(jax.random.key(0), x)["params"]


def new_state():
    return oc.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state, batch):
    x, y = batch

    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))
