"""A second CheckpointManager (a restart in the same process, a second run, an eval job
that trains a little) on an equal state with the same optimizer object reuses the compiled
train step: the window variants are keyed on the plan *by value*, so no new compile."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from flax import nnx

import overlap_ckpt

from . import loop_models as M

STEPS = 9  # windows of 4 (steps 3, 4) and 8 (steps 7, 8): every variant of the step runs


def _linen():
    model = M.MLP()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))  # one object for every state

    def new_state():  # fresh arrays: a donating step consumes the previous state's
        params = model.init(jax.random.key(0), np.ones((1, M.FEATURES), np.float32))["params"]
        return overlap_ckpt.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        def loss_fn(params):
            return M.cross_entropy(state.apply_fn({"params": params}, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return new_state, train_step


def _train(mngr, state, train_step, start, steps=STEPS):
    for t in range(start, start + steps):
        state, _ = train_step(state, M.batch(t))
        state = mngr.step(state)
        if mngr.engine.schedule.phase(t + 1) == 0:
            mngr.wait_until_finished()  # no dropped checkpoints: this test is about compiles
    mngr.wait_until_finished()
    return state


def test_second_manager_reuses_compiled_linen_step(tmp_path):
    new_state, train_step = _linen()
    with overlap_ckpt.CheckpointManager(tmp_path / "a", save_interval_steps=4, window=2) as mngr:
        _train(mngr, mngr.prepare(new_state()), train_step, 0)
        assert mngr.all_steps() == [4, 8]
    compiled = train_step._cache_size()
    assert compiled == 3  # the plain step and the two window phases

    # A new manager on an equal, freshly made state with the same tx object.
    with overlap_ckpt.CheckpointManager(tmp_path / "b", save_interval_steps=4, window=2) as mngr:
        _train(mngr, mngr.prepare(new_state()), train_step, 0)
        assert mngr.all_steps() == [4, 8]
    assert train_step._cache_size() == compiled

    # ... and one that restores into it and trains through the next window.
    with overlap_ckpt.CheckpointManager(tmp_path / "a", save_interval_steps=4, window=2) as mngr:
        state = mngr.restore(target_state=new_state())
        assert int(state.step) == 8
        _train(mngr, state, train_step, 8, steps=5)
        assert mngr.all_steps() == [4, 8, 12]
    assert train_step._cache_size() == compiled


def test_second_manager_reuses_compiled_nnx_functional_step(tmp_path):
    tx = optax.adamw(1e-2, weight_decay=1e-4)

    def split():
        model = M.NnxMLP(nnx.Rngs(params=0, dropout=1))
        return nnx.split((model, overlap_ckpt.nnx.Optimizer(model, tx, wrt=nnx.Param)))

    @functools.partial(jax.jit, donate_argnums=1)
    def train_step(graphdef, state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: M.cross_entropy(m(batch["x"]), batch["y"]))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def train(mngr, graphdef, state, start, steps=STEPS):
        for t in range(start, start + steps):
            state, _ = train_step(graphdef, state, M.batch(t))
            state = mngr.step(state)
            if mngr.engine.schedule.phase(t + 1) == 0:
                mngr.wait_until_finished()
        mngr.wait_until_finished()
        return state

    sizes = []
    for name in ("a", "b"):
        graphdef, state = split()
        with overlap_ckpt.CheckpointManager(tmp_path / name, save_interval_steps=4, window=2) as mngr:
            train(mngr, graphdef, mngr.prepare(state, graphdef=graphdef), 0)
            assert mngr.all_steps() == [4, 8]
        sizes.append(train_step._cache_size())
    assert sizes[0] == 3 and sizes[1] == sizes[0], sizes

    graphdef, state = split()
    with overlap_ckpt.CheckpointManager(tmp_path / "a", save_interval_steps=4, window=2) as mngr:
        state = mngr.restore(target_state=state, graphdef=graphdef)
        train(mngr, graphdef, state, 8, steps=5)
        assert mngr.all_steps() == [4, 8, 12]
    assert train_step._cache_size() == sizes[0]
