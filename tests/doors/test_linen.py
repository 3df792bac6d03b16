"""Linen TrainState + CheckpointManager: overlapped checkpoints equal synchronous snapshots,
resume is bitwise, and the usual mistakes give clear errors.

Tiny model (a few thousand parameters), a handful of steps: the machine is shared.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state as flax_train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import compile_threads, run_in_subprocess, run_python

from overlap_ckpt.doors.linen import TrainState
from overlap_ckpt.manager import CheckpointManager
from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, TransformerLM, linen_init, linen_loss_fn

CFG = LMConfig.preset("tiny", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=8)
DATA = SyntheticTokens(CFG.vocab_size, CFG.seq_len, batch_size=2, seed=0)
INTERVAL = 4


class CountingState(TrainState):
    """A user subclass with an extra pytree field (saved next to params/opt_state)."""

    loss_sum: Any = None


def make_state(cfg: LMConfig = CFG, seed: int = 0, cls=CountingState):
    model = TransformerLM(cfg)
    kwargs = {"loss_sum": jnp.zeros((), jnp.float32)} if cls is CountingState else {}
    return cls.create(apply_fn=model.apply, params=linen_init(cfg, seed),
                      tx=optax.adamw(1e-2, weight_decay=0.01), **kwargs)


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state, batch):
    loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads, loss_sum=state.loss_sum + loss), loss


def snapshot(state) -> dict:
    """What a user would save synchronously: a host copy of the state's pytree fields."""
    tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "loss_sum": state.loss_sum}
    return jax.tree.map(lambda x: np.array(jax.device_get(x), copy=True), tree)


def train(mngr: CheckpointManager, state, start: int, stop: int, snaps: dict | None = None):
    losses = []
    for t in range(start, stop):
        state, loss = train_step(state, DATA.batch(t))
        state = mngr.step(state)
        losses.append(np.asarray(loss))
        if snaps is not None and mngr.should_save(t + 1):
            snaps[t + 1] = snapshot(state)
    return state, losses


def assert_tree_bitwise(saved, expected, where=""):
    s_leaves = jax.tree_util.tree_flatten_with_path(saved)[0]
    e_leaves = jax.tree_util.tree_flatten_with_path(expected)[0]
    assert len(s_leaves) == len(e_leaves), where
    for (ps, s), (pe, e) in zip(s_leaves, e_leaves):
        s, e = np.asarray(s), np.asarray(e)
        assert s.shape == e.shape and s.dtype == e.dtype, (where, jax.tree_util.keystr(ps), s.dtype, e.dtype)
        np.testing.assert_array_equal(s.reshape(-1).view(np.uint8), e.reshape(-1).view(np.uint8),
                                      err_msg=f"{where}{jax.tree_util.keystr(pe)}")


def saved_as_state_tree(raw: dict, like: dict) -> dict:
    """The restored plain-numpy tree (dicts/lists) put into the structure of ``like``."""
    out = {}
    for key in like:
        if key == "opt_state":
            # Orbax-style plain restore returns optax namedtuples as lists/dicts; compare leaves.
            out[key] = jax.tree.unflatten(jax.tree.structure(like[key]), jax.tree.leaves(raw[key]))
        else:
            out[key] = raw[key]
    return out


@pytest.mark.parametrize("window", [1, 2, 3])
def test_overlapped_checkpoints_equal_sync_snapshots_and_resume(tmp_path, window):
    steps = 2 * INTERVAL + 1  # windows of V=4 and V=8 complete
    snaps: dict[int, dict] = {}
    with CheckpointManager(tmp_path / "run", save_interval_steps=INTERVAL, window=window) as mngr:
        state = mngr.prepare(make_state())
        state, ref_losses = train(mngr, state, 0, steps, snaps)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]
        assert mngr.engine.windows_completed == 2 and mngr.engine.windows_aborted == 0
        for v in (4, 8):
            raw, meta = mngr.store.restore(v)
            assert set(raw) == {"step", "params", "opt_state", "loss_sum"}
            assert int(raw["step"]) == v
            assert_tree_bitwise(saved_as_state_tree(raw, snaps[v]), snaps[v], where=f"V={v} ")

    # Resume from V=4 in a fresh manager and state: identical losses, identical checkpoint 8.
    with CheckpointManager(tmp_path / "run", save_interval_steps=INTERVAL, window=window) as mngr:
        state = mngr.restore(4, target_state=make_state(seed=1))
        assert int(state.step) == 4
        state, losses = train(mngr, state, 4, steps)
        mngr.wait_until_finished()
        for a, b in zip(losses, ref_losses[4:]):
            np.testing.assert_array_equal(a.reshape(-1).view(np.uint32), b.reshape(-1).view(np.uint32))
        restored = mngr.restore(8, target_state=make_state(seed=2))
        assert_tree_bitwise(snapshot(restored), snaps[8], where="restore V=8 ")


def test_plain_flax_train_state_is_refused(tmp_path):
    plain = flax_train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=1) as mngr:
        with pytest.raises(TypeError, match=r"overlap_ckpt\.TrainState"):
            mngr.prepare(plain)
        with pytest.raises(TypeError, match=r"overlap_ckpt\.TrainState"):
            mngr.step(plain)


def test_restore_into_different_shapes_names_the_leaf(tmp_path):
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=1) as mngr:
        state = mngr.prepare(make_state())
        state, _ = train(mngr, state, 0, INTERVAL + 1)
        mngr.wait_until_finished()
        wider = make_state(CFG.replace(d_ff=48))
        with pytest.raises(Exception) as info:
            mngr.restore(4, target_state=wider)
        msg = str(info.value)
        assert "fc1" in msg and "kernel" in msg and "(16, 32)" in msg and "(16, 48)" in msg, msg


def test_explicit_final_save_and_unprepared_state_behaves_like_flax(tmp_path):
    with CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=2) as mngr:
        state = mngr.prepare(make_state())
        state, _ = train(mngr, state, 0, 6)
        assert mngr.save(6, state) is False           # not a save step
        assert mngr.save(6, state, force=True) is True
        expected = snapshot(state)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 6]
        raw, _ = mngr.store.restore(6)
        assert_tree_bitwise(saved_as_state_tree(raw, expected), expected)
    # Without a manager the state is a plain Flax TrainState (no plan, no outbox).
    plain = make_state()
    out, _ = train_step(plain, DATA.batch(0))
    assert out.ckpt_outbox is None and int(out.step) == 1


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return jnp.mean((h @ params["dense2"]["kernel"] + params["dense2"]["bias"] - y) ** 2)


def fsdp_mlp():
    """Kernels sharded over the devices, biases replicated, the batch sharded, and a jit
    without ``out_shardings``: XLA shards the replicated biases (and their moments) from
    the first step on, so the state at the first window is not placed as at ``prepare``.
    Returns the state's params, the jitted step and the batch of step ``t``."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    specs = {"dense1": {"kernel": P(None, "data"), "bias": P()}, "dense2": {"kernel": P("data", None), "bias": P()}}
    rng = np.random.default_rng(0)
    params = {layer: {name: jax.device_put(rng.standard_normal(shape, dtype=np.float32) * 0.3,
                                           NamedSharding(mesh, specs[layer][name]))
                      for name, shape in (("kernel", kernel), ("bias", kernel[1:]))}
              for layer, kernel in (("dense1", (8, 16)), ("dense2", (16, 4)))}

    @functools.partial(jax.jit, donate_argnums=0)
    def fsdp_step(state, x, y):
        loss, grads = jax.value_and_grad(mlp_loss)(state.params, x, y)
        return state.apply_gradients(grads=grads), loss

    def batch(t):
        data = np.random.default_rng([1, t]).standard_normal((4, 12), dtype=np.float32)
        return tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (data[:, :8], data[:, 8:]))

    return params, fsdp_step, batch


def fsdp_loop_without_out_shardings(directory: str) -> None:
    params, step, batch = fsdp_mlp()
    for window in (2, 3):
        snaps = {}
        with CheckpointManager(f"{directory}/k{window}", save_interval_steps=INTERVAL, window=window) as mngr:
            state = mngr.prepare(TrainState.create(apply_fn=None, params=jax.tree.map(jnp.copy, params),
                                                   tx=optax.adam(1e-2)))
            for t in range(2 * INTERVAL + 1):
                state, _ = step(state, *batch(t))
                state = mngr.step(state)
                if mngr.should_save(t + 1):
                    snaps[t + 1] = jax.tree.map(lambda x: np.array(x, copy=True), {
                        "step": state.step, "params": state.params, "opt_state": state.opt_state})
            # The premise: the step placed a replicated leaf otherwise than prepare saw it.
            assert state.params["dense1"]["bias"].sharding.spec != P(), state.params["dense1"]["bias"].sharding
            mngr.wait_until_finished()
            assert mngr.all_steps() == [4, 8] and mngr.engine.windows_aborted == 0
            for v in (4, 8):
                raw, _ = mngr.store.restore(v)
                assert_tree_bitwise(saved_as_state_tree(raw, snaps[v]), snaps[v], where=f"K={window} V={v} ")


def explicit_axes_loop_without_set_mesh(directory: str) -> None:
    """The state on a mesh of ``jax.make_mesh``'s default (explicit) axes, placed with
    ``jax.device_put``, its step jitted and called with no ``jax.set_mesh``: each window's
    checkpoint equals the state the loop holds at that step."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)
    params = {"kernel": jax.device_put(rng.standard_normal((8, 4), dtype=np.float32), NamedSharding(mesh, P("data"))),
              "bias": jax.device_put(np.zeros(4, np.float32), NamedSharding(mesh, P()))}

    @functools.partial(jax.jit, donate_argnums=0)
    def explicit_step(state, x):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["kernel"] + p["bias"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    for window in (1, 2):
        snaps = {}
        with CheckpointManager(f"{directory}/k{window}", save_interval_steps=INTERVAL, window=window) as mngr:
            state = mngr.prepare(TrainState.create(apply_fn=None, params=jax.tree.map(jnp.copy, params),
                                                   tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))))
            for t in range(2 * INTERVAL + 1):
                x = np.random.default_rng([1, t]).standard_normal((4, 8), dtype=np.float32)
                state = mngr.step(explicit_step(state, x))
                if mngr.should_save(t + 1):
                    snaps[t + 1] = jax.tree.map(lambda a: np.array(a, copy=True), {
                        "step": state.step, "params": state.params, "opt_state": state.opt_state})
            mngr.wait_until_finished()
            assert mngr.all_steps() == [4, 8] and mngr.engine.windows_aborted == 0
            for v in (4, 8):
                raw, _ = mngr.store.restore(v)
                assert_tree_bitwise(saved_as_state_tree(raw, snaps[v]), snaps[v], where=f"K={window} V={v} ")


def fsdp_loop_compiled_ahead(directory: str) -> None:
    import threading

    compiles = compile_threads("jit(fsdp_step)")  # the thread of every compile of the step
    params, step, batch = fsdp_mlp()
    with CheckpointManager(directory, save_interval_steps=INTERVAL, window=2) as mngr:
        state = mngr.prepare(TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2)))
        compiling = mngr.compile_ahead(step, state, *batch(0))
        state = mngr.step(step(state, *batch(0))[0])
        compiling.join()
        for t in range(1, 2 * INTERVAL + 1):
            state = mngr.step(step(state, *batch(t))[0])
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]
    # The user's own program compiles twice (the second call's inputs are placed otherwise),
    # the two window variants once each, ahead, for the inputs the windows have.
    main = threading.main_thread().name
    assert compiles.count(main) == 2 and compiles.count("overlap-ckpt-compile-ahead") == 2, compiles


def test_a_step_that_shards_a_replicated_leaf_is_checkpointed_exactly(tmp_path):
    """The window is planned on the state as the step places it: a plan made from the state
    at ``prepare`` expected a replicated bias whose gradient and moments came back in
    halves, and the replay failed ("add got incompatible shapes (8,), (16,)")."""
    run_in_subprocess(__file__, "fsdp_loop_without_out_shardings", str(tmp_path), devices=2)


def test_a_mesh_of_explicit_axes_without_set_mesh_is_checkpointed_exactly(tmp_path):
    """``jax.make_mesh`` makes explicit axes by default (jax 0.10); a loop that places its
    state on them and never calls ``jax.set_mesh`` failed at its first window step: the
    capture's sharding constraint named an explicit axis with no mesh in context ("can only
    refer to Auto axes")."""
    run_in_subprocess(__file__, "explicit_axes_loop_without_set_mesh", str(tmp_path), devices=2)


def test_compile_ahead_compiles_the_variants_for_the_state_as_the_first_step_placed_it(tmp_path):
    """compile_ahead is given the state before the first step; when that step moved a leaf,
    the variants are compiled for the state as it is after it (they were compiled for the
    old placement, and again on the training thread at the first window)."""
    run_in_subprocess(__file__, "fsdp_loop_compiled_ahead", str(tmp_path), devices=2)


LINEN_LOOP = """
import sys, tempfile
import flax.linen as nn, jax, jax.numpy as jnp, optax
import overlap_ckpt as oc
import overlap_ckpt.tools.cli  # the command, and the demo's models

model = nn.Dense(4)
x = jnp.ones((2, 3))
state = oc.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
                             tx=optax.adam(1e-2))

@jax.jit
def train_step(state):
    grads = jax.grad(lambda p: jnp.sum(state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

directory = tempfile.mkdtemp()
with oc.CheckpointManager(directory, save_interval_steps=2, window=2) as mngr:
    state = mngr.prepare(state)
    mngr.compile_ahead(train_step, state)
    for _ in range(5):
        state = mngr.step(train_step(state))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 4], mngr.all_steps()
    mngr.restore(target_state=state)
print("linen loop imported flax.nnx:", "flax.nnx" in sys.modules)
print("nnx door:", oc.nnx.Optimizer.__name__, "flax.nnx" in sys.modules)
"""


def test_a_linen_loop_never_imports_nnx():
    """``import overlap_ckpt``, its command and a Linen loop (prepare, compile-ahead,
    windows, restore) leave flax.nnx unimported (about 1 s of every start-up); ``overlap_ckpt.nnx`` loads it."""
    proc = run_python(LINEN_LOOP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "linen loop imported flax.nnx: False" in lines and "nnx door: Optimizer True" in lines, proc.stdout
