"""One training process of a loop style: ``python tests/loops/worker.py --style S --dir D``.

Each style below is a training loop written the way its users write it (Flax's imagenet
example with ``jax.pmap``, Flax's FSDP guide with ``nn.get_sharding`` and
``jax.jit(in_shardings=..., out_shardings=...)``, JAX's explicit sharding, NNX with
``nnx.jit`` and in the functional ``split``/``merge`` style, ``jax.shard_map``...). The
lines that belong to overlap_ckpt are the ``CheckpointManager``, ``prepare``/``restore``
and one ``mngr.step`` per step; the lines that belong to this harness are
``h.before_step``, ``h.after_step`` and ``h.restored``. ``h.before_step`` waits for the
previous checkpoint before each window (a tiny step is faster than a persist here, and the
store would rather drop a checkpoint than wait), so every run commits the same steps.

Every run checkpoints with ``save_interval_steps=4, window=2`` (windows of 4, 8, 12, 16
run at steps 3-4, 7-8, 11-12, 15-16). ``--resume`` restores the latest committed step
first (``mngr.restore(target_state=...)``). ``--kill`` waits for the checkpoints before
the third window (4 and 8), runs phase 0 of that window (step 11) and SIGKILLs itself
right after it.

stdout: one JSON object per line: ``{"ev": "step", "t", "loss" (float32 bits), "phase"}``,
``{"ev": "settled", "steps"}`` before a kill, ``{"ev": "restored", "mismatches"}`` after a
Linen restore (leaves whose shape, dtype or sharding differ from the target's).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils, nnx
from flax.training import common_utils
from flax.training.dynamic_scale import DynamicScale
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P, reshard

import overlap_ckpt

import loop_models as M

KILL_WINDOW = 12  # the third window: its phase 0 runs, then the process dies
STYLES: dict[str, Any] = {}


def style(fn):
    STYLES[fn.__name__] = fn
    return fn


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class Harness:
    """What the test needs from a loop: its losses, and a SIGKILL at a known point."""

    def __init__(self, args):
        self.dir, self.steps, self.resume, self.kill = args.dir, args.steps, args.resume, args.kill

    def _kill_step(self, t: int, mngr) -> bool:
        schedule = mngr.engine.schedule
        phase = schedule.phase(t)
        return self.kill and phase == 0 and schedule.version(t, phase) == KILL_WINDOW

    def before_step(self, t: int, mngr) -> None:
        if mngr.engine.schedule.phase(t) == 0:
            # The previous checkpoint is on storage before the next window starts: on this
            # loaded 2-core machine a tiny step is faster than a persist, and the store would
            # drop a checkpoint rather than wait. Which steps are committed is then the same
            # in every run, and known at the kill.
            mngr.wait_until_finished()
        if self._kill_step(t, mngr):
            emit(ev="settled", steps=mngr.all_steps())

    def restored(self, state, like) -> None:
        """Report leaves of the restored ``state`` whose shape, dtype or sharding differ
        from the target it was restored into (``like``)."""
        bad = []
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(like)):
            if not (isinstance(x, jax.Array) and isinstance(y, jax.Array)):
                continue
            same_sharding = x.sharding.is_equivalent_to(y.sharding, x.ndim)
            if (x.shape, x.dtype) != (y.shape, y.dtype) or not same_sharding:
                bad.append(f"{jax.tree_util.keystr(path)}: {x.dtype}{x.shape} {x.sharding} "
                           f"vs {y.dtype}{y.shape} {y.sharding}")
        emit(ev="restored", mismatches=bad)

    def after_step(self, t: int, loss, mngr) -> None:
        bits = int(np.asarray(loss, dtype=np.float32).reshape(()).view(np.uint32))
        emit(ev="step", t=t, loss=bits, phase=mngr.engine.schedule.phase(t))
        if self._kill_step(t, mngr):
            os.kill(os.getpid(), signal.SIGKILL)


# -- a. Linen + FSDP (Flax's "scale up on multiple devices" guide) ---------------------------
@style
def linen_fsdp(h: Harness) -> None:
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    model = M.MLP(partition="fsdp")  # kernels: nn.with_partitioning(init, ("fsdp", None))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-4))
    x_sharding = NamedSharding(mesh, P("fsdp"))

    def init_fn(key, x):
        variables = model.init(key, x)
        return overlap_ckpt.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)

    key, x = jax.random.key(0), jnp.ones((M.BATCH, M.FEATURES))
    abstract_state = jax.eval_shape(init_fn, key, x)
    state_sharding = nn.get_sharding(abstract_state, mesh)
    jit_init_fn = jax.jit(init_fn, in_shardings=(NamedSharding(mesh, P()), x_sharding),
                          out_shardings=state_sharding)

    @functools.partial(jax.jit, in_shardings=(state_sharding, x_sharding),
                       out_shardings=(state_sharding, None), donate_argnums=0)
    def train_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return M.cross_entropy(logits, batch["y"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
        if h.resume:
            target = jit_init_fn(key, x)
            state = mngr.restore(target_state=target)
            h.restored(state, like=target)
        else:
            state = mngr.prepare(jit_init_fn(key, x))
        for t in range(int(state.step), h.steps):
            h.before_step(t, mngr)
            state, loss = train_step(state, M.batch(t))
            state = mngr.step(state)
            h.after_step(t, loss, mngr)


# -- b. Linen + jax.pmap (Flax's imagenet example) --------------------------------------------
class PmapTrainState(overlap_ckpt.TrainState):
    batch_stats: Any


def pmap_create_state(tx) -> PmapTrainState:
    model = M.CNN()
    variables = model.init(jax.random.key(0), np.ones((1, 8, 8, 1), np.float32), train=False)
    return PmapTrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                                 batch_stats=variables["batch_stats"])


def pmap_train_step(state, batch):
    """The imagenet example's step: gradients and batch statistics averaged over devices."""
    def loss_fn(params):
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, batch["image"], train=True,
            mutable=["batch_stats"])
        return M.cross_entropy(logits, batch["label"]), new_model_state

    (loss, new_model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = lax.pmean(grads, axis_name="batch")
    batch_stats = lax.pmean(new_model_state["batch_stats"], axis_name="batch")
    new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    return new_state, lax.pmean(loss, axis_name="batch")


def pmap_loop(h: Harness, p_train_step, create_train_state, place) -> None:
    """The imagenet example's loop; ``place`` turns a fresh state into what ``p_train_step``
    takes (replicated or as it is)."""
    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
        if h.resume:
            target = place(create_train_state())
            state = mngr.restore(target_state=target)
            h.restored(state, like=target)
        else:
            state = mngr.prepare(place(create_train_state()))
        for t in range(int(np.asarray(state.step).reshape(-1)[0]), h.steps):
            h.before_step(t, mngr)
            state, loss = p_train_step(state, common_utils.shard(M.image_batch(t)))
            state = mngr.step(state)
            h.after_step(t, loss[0], mngr)


@style
def linen_pmap(h: Harness) -> None:
    def create_train_state():
        schedule = optax.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=5, decay_steps=h.steps)
        return pmap_create_state(optax.sgd(schedule, momentum=0.9, nesterov=True))

    p_train_step = jax.pmap(pmap_train_step, axis_name="batch", donate_argnums=(0,))
    pmap_loop(h, p_train_step, create_train_state, jax_utils.replicate)


# -- b2. Linen + jax.pmap over one broadcast state (in_axes=None), as Flax's newer examples ----
@style
def linen_pmap_broadcast(h: Harness) -> None:
    p_train_step = jax.pmap(pmap_train_step, axis_name="batch", in_axes=(None, 0), out_axes=(None, 0))
    pmap_loop(h, p_train_step, lambda: pmap_create_state(optax.adamw(1e-2, weight_decay=1e-4)), lambda s: s)


# -- c. explicit sharding (sharding in types, jax.set_mesh, reshard) ------------------------
@style
def explicit_mesh(h: Harness) -> None:
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    model = M.MLP()

    def create_train_state():
        params = model.init(jax.random.key(0), np.ones((1, M.FEATURES), np.float32))["params"]
        # FSDP: every kernel's rows split over "data", biases replicated.
        params = jax.tree.map(lambda p: reshard(p, P("data") if p.ndim == 2 else P()), params)
        return overlap_ckpt.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-2))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        def loss_fn(params):
            gathered = jax.tree.map(lambda p: reshard(p, P()), params)  # all-gather for the forward
            logits = state.apply_fn({"params": gathered}, batch["x"])
            return M.cross_entropy(logits, batch["y"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    with jax.set_mesh(mesh):
        with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
            if h.resume:
                target = create_train_state()
                state = mngr.restore(target_state=target)
                h.restored(state, like=target)
            else:
                state = mngr.prepare(create_train_state())
            for t in range(int(state.step), h.steps):
                h.before_step(t, mngr)
                batch = jax.device_put(M.batch(t), P("data"))
                state, loss = train_step(state, batch)
                state = mngr.step(state)
                h.after_step(t, loss, mngr)


# -- d. NNX with nnx.jit -------------------------------------------------------------------
def nnx_loss_fn(model, batch):
    return M.cross_entropy(model(batch["x"]), batch["y"])


def nnx_create():
    model = M.NnxMLP(nnx.Rngs(params=0, dropout=1))
    optimizer = overlap_ckpt.nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=1e-4), wrt=nnx.Param)
    return model, optimizer


def nnx_jit_loop(h: Harness, model, optimizer, loss_fn, batch, report=lambda optimizer: None) -> None:
    """The nnx.jit loop of Flax's NNX examples (``report`` walks the optimizer's state every
    step, as their logging does)."""
    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    report(optimizer)
    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
        if h.resume:
            mngr.restore(target_state=optimizer, model=model)
        else:
            mngr.prepare(optimizer, model)
        mngr.compile_ahead(train_step, model, optimizer, batch(0))
        for t in range(int(optimizer.step[...]), h.steps):
            h.before_step(t, mngr)
            loss = train_step(model, optimizer, batch(t))
            mngr.step(optimizer)
            report(optimizer)
            h.after_step(t, loss, mngr)


@style
def nnx_jit(h: Harness) -> None:
    nnx_jit_loop(h, *nnx_create(), nnx_loss_fn, M.batch)


# -- e. NNX, functional: split once, jax.jit, merge / nnx.state --------------------------------
@style
def nnx_functional(h: Harness) -> None:
    @functools.partial(jax.jit, donate_argnums=1)
    def train_step(graphdef, state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    graphdef, state = nnx.split(nnx_create())
    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
        if h.resume:
            state = mngr.restore(target_state=state, graphdef=graphdef)
        else:
            state = mngr.prepare(state, graphdef=graphdef)
        _, optimizer = nnx.merge(graphdef, state)
        for t in range(int(optimizer.step[...]), h.steps):
            h.before_step(t, mngr)
            state, loss = train_step(graphdef, state, M.batch(t))
            state = mngr.step(state)
            h.after_step(t, loss, mngr)


# -- e2. NNX LM the way Flax's NNX examples write it: nnx.jit, and the state walked ----------
def nnx_lm_create():
    from overlap_ckpt.tools.models import LMConfig, nnx_init

    config = LMConfig.preset("tiny", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=8)
    model = nnx_init(config, seed=0)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, b2=0.98, weight_decay=1e-4))
    return model, overlap_ckpt.nnx.Optimizer(model, tx, wrt=nnx.Param)


def lm_batch(t: int) -> dict:
    from overlap_ckpt.tools.models import SyntheticTokens

    return SyntheticTokens(64, 8, batch_size=4, seed=0).batch(t)


def sharding_report(optimizer) -> dict:
    """What Flax's gemma example prints before training, and the logging such loops do every
    step: every variable's shape, dtype and value, the parameter count, a tree map of
    zeros over the whole state, an EMA-style copy of the params."""
    report = {"/".join(map(str, path)): (v.shape, str(v.dtype), float(jnp.sum(jnp.abs(v[...]))))
              for path, v in nnx.to_flat_state(nnx.state(optimizer))}
    count = sum(x.size for x in jax.tree.leaves(nnx.state(optimizer, nnx.Param)))
    zeros = jax.tree.map(jnp.zeros_like, nnx.state(optimizer))
    ema = jax.tree.map(lambda p: 0.999 * p, nnx.state(optimizer, nnx.OptState))
    assert len(jax.tree.leaves(zeros)) == len(report) and jax.tree.leaves(ema)
    return {"variables": len(report), "count": count}


@style
def nnx_lm_jit(h: Harness) -> None:
    from overlap_ckpt.tools.models import nnx_loss_fn

    nnx_jit_loop(h, *nnx_lm_create(), nnx_loss_fn, lm_batch, report=sharding_report)


# -- e3. NNX LM, jax.jit over NNX objects: nnx.state in, nnx.update after --------------------
@style
def nnx_lm_state_update(h: Harness) -> None:
    from overlap_ckpt.tools.models import nnx_loss_fn

    @functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
    def train_step(graphdef, state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    model, optimizer = nnx_lm_create()
    graphdef = nnx.graphdef((model, optimizer))
    sharding_report(optimizer)
    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
        if h.resume:
            state = mngr.restore(target_state=nnx.state((model, optimizer)), graphdef=graphdef)
        else:
            state = mngr.prepare(nnx.state((model, optimizer)), graphdef=graphdef)
        nnx.update((model, optimizer), state)
        for t in range(int(optimizer.step[...]), h.steps):
            h.before_step(t, mngr)
            state, loss = train_step(graphdef, nnx.state((model, optimizer)), lm_batch(t))
            state = mngr.step(state)
            nnx.update((model, optimizer), state)
            sharding_report(optimizer)
            h.after_step(t, loss, mngr)


# -- f. TrainState with extra fields: DynamicScale, a raw and a typed PRNG key ---------------
class FieldsTrainState(overlap_ckpt.TrainState):
    dynamic_scale: DynamicScale
    rng: Any  # raw uint32 key data, jax.random.PRNGKey: noise on the inputs
    dropout_key: Any  # typed key, jax.random.key: dropout


@style
def trainstate_fields(h: Harness) -> None:
    model = M.MLP(dropout=0.2)

    def create_train_state():
        params = model.init(jax.random.key(0), np.ones((1, M.FEATURES), np.float32))["params"]
        return FieldsTrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2),
                                       dynamic_scale=DynamicScale(growth_interval=5),
                                       rng=jax.random.PRNGKey(1), dropout_key=jax.random.key(2))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        rng, noise_key = jax.random.split(state.rng)
        dropout_key, step_dropout_key = jax.random.split(state.dropout_key)
        x = batch["x"] + 0.05 * jax.random.normal(noise_key, batch["x"].shape)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x, train=True, rngs={"dropout": step_dropout_key})
            return M.cross_entropy(logits, batch["y"])

        # As in Flax's mixed-precision examples: scaled loss, and skip non-finite updates.
        dynamic_scale, is_fin, loss, grads = state.dynamic_scale.value_and_grad(loss_fn)(state.params)
        new_state = state.apply_gradients(grads=grads, rng=rng, dropout_key=dropout_key)
        select = functools.partial(jnp.where, is_fin)
        new_state = new_state.replace(
            opt_state=jax.tree.map(select, new_state.opt_state, state.opt_state),
            params=jax.tree.map(select, new_state.params, state.params),
            dynamic_scale=dynamic_scale)
        return new_state, loss

    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
        if h.resume:
            target = create_train_state()
            state = mngr.restore(target_state=target)
            h.restored(state, like=target)
        else:
            state = mngr.prepare(create_train_state())
        for t in range(int(state.step), h.steps):
            h.before_step(t, mngr)
            state, loss = train_step(state, M.batch(t))
            state = mngr.step(state)
            h.after_step(t, loss, mngr)


# -- g. the app's own saved tree and item name ------------------------------------------------
def app_save_tree(t):
    return {"model": t["params"], "optimizer": t["opt_state"], "step": t["step"]}


@style
def app_layout(h: Harness) -> None:
    model = M.app_model()

    def create_train_state():
        params = model.init(jax.random.key(0), np.ones((1, M.FEATURES), np.float32))["params"]
        return overlap_ckpt.TrainState.create(apply_fn=model.apply, params=params, tx=M.app_tx())

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        def loss_fn(params):
            return M.cross_entropy(state.apply_fn({"params": params}, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2, save_tree=app_save_tree,
                                        item_name="state") as mngr:
        if h.resume:
            target = create_train_state()
            state = mngr.restore(target_state=target)
            h.restored(state, like=target)
        else:
            state = mngr.prepare(create_train_state())
        for t in range(int(state.step), h.steps):
            h.before_step(t, mngr)
            state, loss = train_step(state, M.batch(t))
            state = mngr.step(state)
            h.after_step(t, loss, mngr)


# -- h. data-parallel gradients in jax.shard_map ---------------------------------------------
@style
def shard_map(h: Harness) -> None:
    mesh = jax.make_mesh((2,), ("batch",), axis_types=(AxisType.Auto,))
    model = M.MLP()
    replicated, data_sharding = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))

    def create_train_state():
        params = model.init(jax.random.key(0), np.ones((1, M.FEATURES), np.float32))["params"]
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
        state = overlap_ckpt.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        return jax.device_put(state, replicated)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())
        def loss_and_grads(params, batch):
            def loss_fn(params):
                return M.cross_entropy(state.apply_fn({"params": params}, batch["x"]), batch["y"])

            loss, grads = jax.value_and_grad(loss_fn)(params)
            return lax.pmean(loss, "batch"), lax.pmean(grads, "batch")

        loss, grads = loss_and_grads(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    with overlap_ckpt.CheckpointManager(h.dir, save_interval_steps=4, window=2) as mngr:
        if h.resume:
            target = create_train_state()
            state = mngr.restore(target_state=target)
            h.restored(state, like=target)
        else:
            state = mngr.prepare(create_train_state())
        for t in range(int(state.step), h.steps):
            h.before_step(t, mngr)
            state, loss = train_step(state, jax.device_put(M.batch(t), data_sharding))
            state = mngr.step(state)
            h.after_step(t, loss, mngr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--style", required=True, choices=sorted(STYLES))
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--kill", action="store_true")
    args = p.parse_args(argv)
    STYLES[args.style](Harness(args))
    emit(ev="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
