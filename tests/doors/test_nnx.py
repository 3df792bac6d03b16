"""NNX Optimizer + CheckpointManager: overlapped checkpoints equal synchronous snapshots,
resume is bitwise, plain nnx.Optimizer, the pre-0.11 update call and shape mismatches give
clear errors."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from overlap_ckpt.manager import CheckpointManager
from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, nnx_init, nnx_loss_fn
from overlap_ckpt.doors.nnx import Optimizer, to_plain
from overlap_ckpt.errors import UnsupportedOptimizerError

from conftest import compile_threads, run_in_subprocess

CFG = LMConfig.preset("tiny", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=8)
DATA = SyntheticTokens(CFG.vocab_size, CFG.seq_len, batch_size=2, seed=0)
INTERVAL = 4


def make(cfg=CFG, seed=0):
    model = nnx_init(cfg, seed)
    return model, Optimizer(model, optax.adamw(1e-2, weight_decay=0.01), wrt=nnx.Param)


@nnx.jit(donate_argnums=(0, 1))
def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def snapshot(model, optimizer) -> dict:
    tree = {"step": optimizer.step[...], "params": nnx.as_pure(nnx.state(model, nnx.Param)),
            "opt_state": nnx.as_pure(optimizer.opt_state)}
    return jax.tree.map(lambda x: np.array(jax.device_get(x), copy=True), to_plain(tree))


def train(mngr, model, optimizer, start, stop, snaps=None):
    losses = []
    for t in range(start, stop):
        loss = train_step(model, optimizer, DATA.batch(t))
        mngr.step(optimizer)
        losses.append(np.asarray(loss))
        if snaps is not None and mngr.should_save(t + 1):
            snaps[t + 1] = snapshot(model, optimizer)
    return losses


def bitwise_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def checkpoint_equals(mngr, step: int, snap: dict) -> dict:
    """Checkpoint ``step`` equals the live snapshot taken at that step, bit for bit."""
    raw, _ = mngr.store.restore(step)
    bitwise_equal(raw["params"], snap["params"])
    bitwise_equal(raw["opt_state"], snap["opt_state"])
    return raw


@pytest.mark.parametrize("window", [1, 2, 3])
def test_nnx_checkpoints_equal_sync_snapshots_and_resume(tmp_path, window):
    steps = 2 * INTERVAL + 1
    snaps: dict[int, dict] = {}
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=window) as mngr:
        model, optimizer = make()
        mngr.prepare(optimizer, model)
        ref = train(mngr, model, optimizer, 0, steps, snaps)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]
        assert mngr.engine.windows_completed == 2
        for v in (4, 8):
            raw = checkpoint_equals(mngr, v, snaps[v])
            assert set(raw) == {"step", "params", "opt_state"}
            assert int(raw["step"]) == v

    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=window) as mngr:
        model, optimizer = make(seed=1)
        mngr.restore(4, target_state=optimizer, model=model)
        assert int(optimizer.step[...]) == 4
        bitwise_equal(snapshot(model, optimizer), snaps[4])
        losses = train(mngr, model, optimizer, 4, steps)
        for a, b in zip(losses, ref[4:]):
            np.testing.assert_array_equal(a.reshape(-1).view(np.uint32), b.reshape(-1).view(np.uint32))


@nnx.jit(donate_argnums=(0, 1))
def train_step_passing_the_loss(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, batch)
    optimizer.update(model, grads, value=loss)
    return loss


def test_extra_update_arguments_the_optimizer_ignores_are_checkpointed_exactly(tmp_path):
    """``update(model, grads, value=loss)`` with adamw (which does not read ``value``): windows
    run, and every checkpoint equals the live state of its step, bit for bit."""
    snaps: dict[int, dict] = {}
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=2) as mngr:
        model, optimizer = make()
        mngr.prepare(optimizer, model)
        for t in range(2 * INTERVAL + 1):
            train_step_passing_the_loss(model, optimizer, DATA.batch(t))
            mngr.step(optimizer)
            if mngr.should_save(t + 1):
                snaps[t + 1] = snapshot(model, optimizer)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8] and mngr.engine.windows_completed == 2
        for v in (4, 8):
            checkpoint_equals(mngr, v, snaps[v])


@nnx.jit
def train_step_returning_updates(model, optimizer, batch):
    grads = nnx.grad(nnx_loss_fn)(model, batch)
    return optimizer.update(model, grads)


@pytest.mark.parametrize("global_scalars", [False, True])
def test_update_returns_the_updates_in_windows_too(tmp_path, global_scalars):
    """``nnx.Optimizer.update`` returns the optax updates; ours does at every step, window
    phases included (with and without global scalars, which take another path through the
    update). Reference: Flax's own nnx.Optimizer stepped from the same state. Window steps
    may differ from a plain step in the last bits (docs/design.md), hence a tolerance."""
    tx = optax.adamw(1e-2, weight_decay=0.01)
    if global_scalars:
        tx = optax.chain(optax.clip_by_global_norm(1e-3), tx)
    flax_model = nnx_init(CFG, 0)
    flax_optimizer = nnx.Optimizer(flax_model, tx, wrt=nnx.Param)
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=3) as mngr:
        model = nnx_init(CFG, 0)
        optimizer = Optimizer(model, tx, wrt=nnx.Param)
        mngr.prepare(optimizer, model)
        for t in range(2 * INTERVAL + 1):
            nnx.update(flax_model, nnx.state(model))
            nnx.update(flax_optimizer, nnx.state(optimizer))
            expected = to_plain(train_step_returning_updates(flax_model, flax_optimizer, DATA.batch(t)))
            updates = train_step_returning_updates(model, optimizer, DATA.batch(t))
            mngr.step(optimizer)
            assert jax.tree.structure(to_plain(updates)) == jax.tree.structure(expected), t
            for got, want in zip(jax.tree.leaves(to_plain(updates)), jax.tree.leaves(expected)):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-9, err_msg=str(t))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8] and mngr.engine.windows_completed == 2
        assert (mngr.engine.plan.analysis.n_globals > 0) == global_scalars


def scale_by_value_when_given() -> optax.GradientTransformationExtraArgs:
    def update(updates, state, params=None, *, value=None, **extra):
        return (updates if value is None else jax.tree.map(lambda u: u * value, updates)), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_extra_update_arguments_that_change_the_update_are_refused_at_the_first_step(tmp_path):
    """An optimizer that reads ``value`` only when given passes ``prepare`` (which cannot see
    the arguments); the first step that passes it is refused, long before the first window.
    The same optimizer without a manager is nnx.Optimizer: it trains, as Flax's does."""
    tx = optax.chain(scale_by_value_when_given(), optax.adam(1e-2))
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=2) as mngr:
        model = nnx_init(CFG, 0)
        optimizer = Optimizer(model, tx, wrt=nnx.Param)
        mngr.prepare(optimizer, model)
        with pytest.raises(UnsupportedOptimizerError, match="value") as info:
            train_step_passing_the_loss(model, optimizer, DATA.batch(0))
        assert "Stop passing them" in str(info.value)
        assert int(optimizer.step[...]) == 0

    ours_model, flax_model = nnx_init(CFG, 0), nnx_init(CFG, 0)
    ours = Optimizer(ours_model, tx, wrt=nnx.Param)  # never given to a manager
    theirs = nnx.Optimizer(flax_model, tx, wrt=nnx.Param)
    for t in range(2):
        train_step_passing_the_loss(ours_model, ours, DATA.batch(t))
        train_step_passing_the_loss(flax_model, theirs, DATA.batch(t))
    bitwise_equal(snapshot(ours_model, ours), snapshot(flax_model, theirs))


def test_plain_nnx_optimizer_and_shape_mismatch(tmp_path):
    model = nnx_init(CFG, 0)
    plain = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=1) as mngr:
        with pytest.raises(TypeError, match=r"overlap_ckpt\.nnx\.Optimizer"):
            mngr.prepare(plain, model)
        model, optimizer = make()
        mngr.prepare(optimizer, model)
        train(mngr, model, optimizer, 0, INTERVAL + 1)
        mngr.wait_until_finished()
        with pytest.raises(TypeError, match=r"update\(model, grads\).*Flax 0\.11"):
            optimizer.update(nnx.state(model, nnx.Param))  # the pre-0.11 call
        model2, optimizer2 = make(CFG.replace(d_ff=48))
        with pytest.raises(Exception) as info:
            mngr.restore(4, target_state=optimizer2, model=model2)
        msg = str(info.value)
        assert "fc1" in msg and "kernel" in msg and "(16, 32)" in msg and "(16, 48)" in msg, msg


def test_compile_ahead_of_an_nnx_jit_step_compiles_every_window_variant_off_the_training_thread(tmp_path):
    """``compile_ahead(train_step, model, optimizer, batch)`` with an ``nnx.jit`` step: the
    window variants compile in the background from abstract copies of the objects, and the
    training thread compiles only the user's own program."""
    import threading

    compiles = compile_threads("nnx_ahead_step")

    @nnx.jit(donate_argnums=(0, 1))
    def nnx_ahead_step(model, optimizer, batch):  # a step of its own: nothing compiled elsewhere
        loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    model, optimizer = make()
    before = snapshot(model, optimizer)
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=2) as mngr:
        mngr.prepare(optimizer, model)
        compiling = mngr.compile_ahead(nnx_ahead_step, model, optimizer, DATA.batch(0))
        bitwise_equal(snapshot(model, optimizer), before)  # the live objects were not touched
        nnx_ahead_step(model, optimizer, DATA.batch(0))
        mngr.step(optimizer)
        compiling.join()
        assert compiles == [threading.main_thread().name] + ["overlap-ckpt-compile-ahead"] * 2, compiles
        for t in range(1, 2 * INTERVAL + 1):
            nnx_ahead_step(model, optimizer, DATA.batch(t))
            mngr.step(optimizer)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [INTERVAL, 2 * INTERVAL]
    assert len(compiles) == 3, compiles  # no window variant compiled on the training thread


def update_both(gen, gen_opt, disc, disc_opt, batch):
    """One step of two models, each with its own optimizer (and manager)."""
    loss_g, grads_g = nnx.value_and_grad(nnx_loss_fn)(gen, batch)
    gen_opt.update(gen, grads_g)
    loss_d, grads_d = nnx.value_and_grad(nnx_loss_fn)(disc, batch)
    disc_opt.update(disc, grads_d)
    return loss_g + loss_d


def gan_loop(directory) -> None:
    """Two models, each with its optimizer and manager, updated in one donating ``nnx.jit``;
    their windows overlap. Each checkpoint equals its own state's synchronous snapshot."""
    step = nnx.jit(update_both, donate_argnums=(0, 1, 2, 3))
    with CheckpointManager(f"{directory}/gen", save_interval_steps=INTERVAL, window=2) as mg, \
            CheckpointManager(f"{directory}/disc", save_interval_steps=INTERVAL, window=2) as md:
        (gen, gen_opt), (disc, disc_opt) = make(seed=0), make(seed=1)
        mg.prepare(gen_opt, gen)
        md.prepare(disc_opt, disc)
        snaps = {}
        for t in range(2 * INTERVAL + 1):
            step(gen, gen_opt, disc, disc_opt, DATA.batch(t))
            mg.step(gen_opt)
            md.step(disc_opt)
            if mg.should_save(t + 1):
                snaps[t + 1] = (snapshot(gen, gen_opt), snapshot(disc, disc_opt))
        for i, mngr in enumerate((mg, md)):
            mngr.wait_until_finished()
            assert mngr.all_steps() == [4, 8]
            for v in (4, 8):
                checkpoint_equals(mngr, v, snaps[v][i])


def test_two_donated_optimizers_in_one_step(tmp_path):
    """Both models and optimizers donated: the runtime aborted the process at the first
    window step when jit paired a donated leaf of one with a host copy of the other
    (overlap_ckpt.core.capture.to_host), so the loop runs in a subprocess."""
    run_in_subprocess(__file__, "gan_loop", str(tmp_path))


def test_compile_ahead_of_an_nnx_step_shared_by_two_managers(tmp_path):
    """Two models and optimizers updated by one ``nnx.jit`` step given to both managers'
    ``compile_ahead``, windows of every 4 and every 6 steps: the training thread compiles the
    plain step only (the phases where both windows meet come from the background compiles
    too), and each checkpoint equals its state's synchronous snapshot."""
    shared_nnx_step = nnx.jit(update_both)
    threads = compile_threads("update_both")  # the gan_loop's step runs in a subprocess
    with CheckpointManager(f"{tmp_path}/gen", save_interval_steps=4, window=2) as mg, \
            CheckpointManager(f"{tmp_path}/disc", save_interval_steps=6, window=2) as md:
        (gen, gen_opt), (disc, disc_opt) = make(seed=0), make(seed=1)
        mg.prepare(gen_opt, gen)
        md.prepare(disc_opt, disc)
        for mngr in (mg, md):
            mngr.compile_ahead(shared_nnx_step, gen, gen_opt, disc, disc_opt, DATA.batch(0))
        snaps = {}
        for t in range(13):
            shared_nnx_step(gen, gen_opt, disc, disc_opt, DATA.batch(t))
            mg.step(gen_opt)
            md.step(disc_opt)
            snaps[t + 1] = (snapshot(gen, gen_opt), snapshot(disc, disc_opt))
        for i, (mngr, steps) in enumerate(((mg, [4, 8, 12]), (md, [6, 12]))):
            mngr.wait_until_finished()
            assert mngr.all_steps() == steps
            for v in steps:
                checkpoint_equals(mngr, v, snaps[v][i])
    assert threads.count("MainThread") == 1, threads


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.numpy.tanh(self.l1(x)))


def fsdp_mlp():
    """Kernels sharded over the devices, biases replicated, the batch sharded, and an
    ``nnx.jit`` step: XLA shards the biases and their moments from the first step on.
    Returns the model, its optimizer, the step and the batch of step ``t``."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = MLP(nnx.Rngs(0))
    for variable, spec in ((model.l1.kernel, P(None, "data")), (model.l2.kernel, P("data", None)),
                           (model.l1.bias, P()), (model.l2.bias, P())):
        variable[...] = jax.device_put(variable[...], NamedSharding(mesh, spec))

    @nnx.jit(donate_argnums=(0, 1))
    def fsdp_step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jax.numpy.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)

    def batch(t):
        data = np.random.default_rng([1, t]).standard_normal((4, 12), dtype=np.float32)
        return tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (data[:, :8], data[:, 8:]))

    return model, Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), fsdp_step, batch


def fsdp_loop_without_out_shardings(directory: str) -> None:
    from jax.sharding import PartitionSpec as P

    model, optimizer, step, batch = fsdp_mlp()
    snaps = {}
    with CheckpointManager(directory, save_interval_steps=INTERVAL, window=2) as mngr:
        mngr.prepare(optimizer, model)
        for t in range(2 * INTERVAL + 1):
            step(model, optimizer, *batch(t))
            mngr.step(optimizer)
            if mngr.should_save(t + 1):
                snaps[t + 1] = snapshot(model, optimizer)
        # The premise: the step placed a replicated leaf otherwise than prepare saw it.
        assert model.l1.bias[...].sharding.spec != P(), model.l1.bias[...].sharding
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8] and mngr.engine.windows_aborted == 0
        for v in (4, 8):
            checkpoint_equals(mngr, v, snaps[v])


def fsdp_loop_compiled_ahead(directory: str) -> None:
    import threading

    compiles = compile_threads("fsdp_step")  # the thread of every compile of the step
    model, optimizer, step, batch = fsdp_mlp()
    with CheckpointManager(directory, save_interval_steps=INTERVAL, window=2) as mngr:
        mngr.prepare(optimizer, model)
        compiling = mngr.compile_ahead(step, model, optimizer, *batch(0))
        step(model, optimizer, *batch(0))
        mngr.step(optimizer)
        compiling.join()
        for t in range(1, 2 * INTERVAL + 1):
            step(model, optimizer, *batch(t))
            mngr.step(optimizer)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]
    # The user's own program compiles twice (the second call's inputs are placed otherwise),
    # the two window variants once each, ahead, for the inputs the windows have.
    main = threading.main_thread().name
    assert compiles.count(main) == 2 and compiles.count("overlap-ckpt-compile-ahead") == 2, compiles


def test_a_step_that_shards_a_replicated_leaf_is_checkpointed_exactly(tmp_path):
    """The window is planned on the state as the step places it (the replay failed with
    "add got incompatible shapes (8,), (16,)" when planned on the state at prepare)."""
    run_in_subprocess(__file__, "fsdp_loop_without_out_shardings", str(tmp_path), devices=2)


def test_compile_ahead_compiles_the_variants_for_the_state_as_the_first_step_placed_it(tmp_path):
    """As with Linen: the model and optimizer as the first step left them, not as they were
    given to compile_ahead."""
    run_in_subprocess(__file__, "fsdp_loop_compiled_ahead", str(tmp_path), devices=2)


def functional_fsdp_loop(directory: str) -> None:
    """The functional style (``nnx.split`` once, ``jax.jit`` over the ``nnx.State``) on the
    same FSDP model: checkpoints bitwise, the window variants compiled ahead for the state
    as the first step placed it."""
    import functools
    import threading

    compiles = compile_threads("functional_step")
    model, optimizer, _, batch = fsdp_mlp()

    @functools.partial(jax.jit, donate_argnums=1)  # no out_shardings
    def functional_step(graphdef, state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: jax.numpy.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    snaps = {}
    with CheckpointManager(directory, save_interval_steps=INTERVAL, window=2) as mngr:
        graphdef, state = nnx.split((model, optimizer))
        state = mngr.prepare(state, graphdef=graphdef)
        compiling = mngr.compile_ahead(functional_step, graphdef, state, *batch(0))
        state = mngr.step(functional_step(graphdef, state, *batch(0)))
        compiling.join()
        for t in range(1, 2 * INTERVAL + 1):
            state = mngr.step(functional_step(graphdef, state, *batch(t)))
            if mngr.should_save(t + 1):
                snaps[t + 1] = snapshot(*nnx.merge(graphdef, state))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8] and not mngr.failed_steps()
        for v in (4, 8):
            checkpoint_equals(mngr, v, snaps[v])
    main = threading.main_thread().name
    assert compiles.count(main) == 2 and compiles.count("overlap-ckpt-compile-ahead") == 2, compiles


def test_functional_style_on_a_step_that_shards_a_replicated_leaf(tmp_path):
    run_in_subprocess(__file__, "functional_fsdp_loop", str(tmp_path), devices=2)
