"""The library at its dependency floors: train, checkpoint, restore, bitwise.

Run by tests/compat/test_orbax_versions.py in a venv holding every dependency at exactly
the minimum pyproject.toml declares (the checkout on ``PYTHONPATH``). A floor that is not
true fails here first: ``prepare`` refusing plain adamw, Orbax or Flax not importing,
TensorStore rejecting a spec option, the NNX door using a newer ``nnx.Optimizer``.

``python floor_smoke.py --dir D --out OUT.pkl`` trains a small model in each loop style
(Flax Linen ``TrainState`` under ``D/linen``, NNX ``Optimizer`` under ``D/nnx``) with
``optax.adamw`` behind a global-norm clip for 10 steps, checkpointing every 4th step over a
window of 2 steps, restores the latest checkpoint into a fresh state, and checks it bit for
bit against the same training without overlap_ckpt. It pickles ``{"versions": {...},
"steps": {style: {step: tree}}}`` with each step as the library reads it back untyped
(nested dicts/lists of numpy arrays): the test has stock Orbax read ``D/<style>`` and compares.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import pickle
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import overlap_ckpt as oc
from overlap_ckpt.storage import CheckpointStore

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "numpy")
STEPS, INTERVAL, WINDOW = 10, 4, 2


def tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3))


def batch(i: int):
    rng = np.random.default_rng(i)
    return rng.standard_normal((8, 4), dtype=np.float32), rng.standard_normal((8, 3), dtype=np.float32)


def assert_same(got, want, what: str) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype != w.dtype or g.tobytes() != w.tobytes():
            raise AssertionError(f"restored {what} differs from the run without overlap_ckpt")


# -- Flax Linen ---------------------------------------------------------------------------------

class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


def linen_state():
    model = LinenModel()
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    return oc.TrainState.create(apply_fn=model.apply, params=params, tx=tx())


@functools.partial(jax.jit, donate_argnums=0)
def linen_step(state, x, y):
    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))


def run_linen(directory: str) -> int:
    with oc.CheckpointManager(directory, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        state = mngr.prepare(linen_state())
        for i in range(STEPS):
            state = mngr.step(linen_step(state, *batch(i)))
        mngr.wait_until_finished()
        latest = mngr.latest_step()
    with oc.CheckpointManager(directory, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        restored = mngr.restore(target_state=linen_state())
    want = linen_state()
    for i in range(latest):
        want = linen_step(want, *batch(i))
    assert_same((restored.step, restored.params, restored.opt_state), (want.step, want.params, want.opt_state),
                f"Linen state at step {latest}")
    return latest


# -- Flax NNX -----------------------------------------------------------------------------------

class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


@nnx.jit(donate_argnums=(0, 1))
def nnx_step(model, optimizer, x, y):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)


def run_nnx(directory: str) -> int:
    def make(optimizer_type):
        model = NnxModel(nnx.Rngs(0))
        return model, optimizer_type(model, tx(), wrt=nnx.Param)

    with oc.CheckpointManager(directory, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        model, optimizer = make(oc.nnx.Optimizer)
        mngr.prepare(optimizer, model)
        for i in range(STEPS):
            nnx_step(model, optimizer, *batch(i))
            mngr.step(optimizer)
        mngr.wait_until_finished()
        latest = mngr.latest_step()
    with oc.CheckpointManager(directory, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        model, optimizer = make(oc.nnx.Optimizer)
        mngr.restore(target_state=optimizer, model=model)
    want_model, want_optimizer = make(nnx.Optimizer)
    for i in range(latest):
        nnx_step(want_model, want_optimizer, *batch(i))
    assert_same((nnx.state(model, nnx.Param), nnx.state(optimizer, nnx.OptState)),
                (nnx.state(want_model, nnx.Param), nnx.state(want_optimizer, nnx.OptState)),
                f"NNX model and optimizer at step {latest}")
    return latest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    steps = {}
    for style, run in (("linen", run_linen), ("nnx", run_nnx)):
        directory = f"{args.dir}/{style}"
        run(directory)
        with CheckpointStore(directory, read_only=True) as store:
            steps[style] = {step: store.restore(step)[0] for step in store.all_steps()}
    with open(args.out, "wb") as f:
        pickle.dump({"versions": {p: importlib.metadata.version(p) for p in PACKAGES}, "steps": steps}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
