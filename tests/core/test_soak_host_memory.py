"""Soak: 100 checkpoints through the real store, and host memory does not grow with them.

Why: host RAM that grows with every save is the most common complaint about async
checkpointing (Orbax #2090). The bound is generous (two state copies): it separates "flat"
from "one copy leaked per checkpoint" (100 copies here), not one allocator page from another.
"""

from __future__ import annotations

import functools
import gc

import jax
import jax.numpy as jnp
import optax

from overlap_ckpt.doors.linen import TrainState
from overlap_ckpt.manager import CheckpointManager


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@functools.partial(jax.jit, donate_argnums=0)
def _train_step(state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"] * x) ** 2) + jnp.sum(p["b"] ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def test_rss_after_100_checkpoints_stays_near_rss_after_10(tmp_path):
    params = {"w": jnp.linspace(-1, 1, 1 << 20, dtype=jnp.float32).reshape(1024, 1024), "b": jnp.zeros(1024)}
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    state_bytes = 3 * sum(x.nbytes for x in jax.tree.leaves(params))  # params + adam's two moments
    rss = {}
    # window=2: each checkpoint copies rows into reused blocks and hands the last slice over
    # as captured; both must be released (or reused) checkpoint after checkpoint.
    with CheckpointManager(tmp_path, save_interval_steps=2, window=2, max_to_keep=1) as mngr:
        state = mngr.prepare(state)
        for t in range(201):
            state = mngr.step(_train_step(state, jnp.float32(1e-3 * (t % 7))))
            if t + 1 in (20, 200):  # after 10 and 100 checkpoint windows
                mngr.wait_until_finished()
                gc.collect()
                rss[t + 1] = _rss()
        mngr.wait_until_finished()  # the window of step 200 ends with the loop's last step
        assert len(mngr.store.history) == 100 and mngr.skipped_steps() == []
    growth = rss[200] - rss[20]
    assert growth <= 2 * state_bytes, (
        f"RSS grew {growth / 2**20:.0f} MiB from checkpoint 10 to 100 (state {state_bytes / 2**20:.0f} MiB)")
