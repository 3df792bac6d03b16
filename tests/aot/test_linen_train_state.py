"""A Linen user's own step on ``overlap_ckpt.TrainState``, jitted with explicit shardings
(FSDP over a v5e:2x2 slice; one H100), compiled through the window context as
``compile_ahead`` compiles it. Reference: the same step on Flax's own ``TrainState``."""

import jax
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec

import overlap_ckpt as oc
from overlap_ckpt.aot import compile_window, lower_in_window, plan_state
from overlap_ckpt.tools.models import LMConfig, TransformerLM, linen_loss_fn

from .conftest import TPU_TARGET, assert_within_plain_plus_outbox, target_or_skip


def abstract_state(state_class, target):
    config = LMConfig.preset("tiny")
    model = TransformerLM(config)
    n = len(target.devices)
    mesh = target.mesh()

    def create():
        params = model.init(jax.random.key(0), jax.numpy.zeros((1, config.seq_len), jax.numpy.int32))["params"]
        return state_class.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))

    def place(x):
        spec = PartitionSpec("fsdp") if x.ndim and x.shape[0] % n == 0 else PartitionSpec()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    state = jax.tree.map(place, jax.eval_shape(create))
    batch = {"tokens": place(jax.ShapeDtypeStruct((2 * n, config.seq_len + 1), jax.numpy.int32))}
    return state, batch


def jitted_step(state, batch):
    def train_step(state, batch):
        grads = jax.grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads)

    shardings = jax.tree.map(lambda x: x.sharding, (state, batch))
    return jax.jit(train_step, in_shardings=shardings, donate_argnums=0)


@pytest.mark.parametrize("target_name", ["h100", TPU_TARGET])
def test_train_state_window_programs(target_name):
    target = target_or_skip(target_name)
    state, batch = abstract_state(oc.TrainState, target)
    flax_state, _ = abstract_state(train_state.TrainState, target)
    plan = plan_state(state, 2)
    assert plan.pack_outbox  # GPU: every item; TPU: those up to 64 KiB (see docs/aot.md)
    report = compile_window(lower_in_window(jitted_step(state, batch), state, batch), plan, target,
                            reference=jitted_step(flax_state, batch).lower(flax_state, batch))
    assert report.plain_is_users_program
    for program in report.phases:
        assert program.host_copies and all(c.asynchronous for c in program.host_copies), program.name
        assert all(c.overlapped for c in program.host_copies), (program.name, program.host_copies)
    assert_within_plain_plus_outbox(report)
