"""The library at its dependency floors: train, checkpoint, restore, bitwise.

Run by tests/compat/test_orbax_versions.py in a venv holding every dependency at exactly
the minimum pyproject.toml declares (the checkout on ``PYTHONPATH``). A floor that is not
true fails here first: ``prepare`` refusing plain adamw, Orbax not importing, TensorStore
rejecting a spec option.

``python floor_smoke.py --dir D --out OUT.pkl`` trains a small Linen model with
``optax.adamw`` behind a global-norm clip for 10 steps, checkpointing every 4th step over
a window of 2 steps, restores the latest checkpoint into a fresh state, and checks it bit
for bit against an uninterrupted run without overlap_ckpt. It pickles ``{"versions": {...},
"steps": {step: tree}}`` with each step as the library reads it back untyped (nested
dicts/lists of numpy arrays): the test has stock Orbax read ``D`` and compares.
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

import overlap_ckpt as oc
from overlap_ckpt.storage import CheckpointStore

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "numpy")
STEPS, INTERVAL, WINDOW = 10, 4, 2


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


def new_state():
    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3))
    return oc.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state, x, y):
    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)
    return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))


def batch(i: int):
    rng = np.random.default_rng(i)
    return rng.standard_normal((8, 4), dtype=np.float32), rng.standard_normal((8, 3), dtype=np.float32)


def reference(steps: int):
    """The same training without overlap_ckpt: what a checkpoint at ``steps`` must hold."""
    state = new_state()
    for i in range(steps):
        state = train_step(state, *batch(i))
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with oc.CheckpointManager(args.dir, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        state = mngr.prepare(new_state())
        for i in range(STEPS):
            state = mngr.step(train_step(state, *batch(i)))
        mngr.wait_until_finished()
        steps = mngr.all_steps()
    latest = max(steps)
    with oc.CheckpointManager(args.dir, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        restored = mngr.restore(target_state=new_state())
    want = reference(latest)
    for name in ("step", "params", "opt_state"):
        for got, exp in zip(jax.tree.leaves(getattr(restored, name)), jax.tree.leaves(getattr(want, name)), strict=True):
            got, exp = np.asarray(got), np.asarray(exp)
            if got.dtype != exp.dtype or got.tobytes() != exp.tobytes():
                raise AssertionError(f"restored {name} differs from the uninterrupted run at step {latest}")
    with CheckpointStore(args.dir, read_only=True) as store:
        trees = {step: store.restore(step)[0] for step in steps}
    with open(args.out, "wb") as f:
        pickle.dump({"versions": {p: importlib.metadata.version(p) for p in PACKAGES}, "steps": trees}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
