"""The benchmark language model's train step on a target, as abstract arguments only.

Why abstract: a ~1B-parameter state is 12 GB; compiling for a target needs only its
shapes and shardings (``jax.ShapeDtypeStruct`` on the target's devices), so nothing is
allocated on this machine. The step is written as a user would with the functional core
(``capture_update`` with an explicit ticket); the reference is the same step with plain
optax, compiled without overlap_ckpt.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ...aot.targets import Target
from ...core import backend
from ...core.capture import capture_update
from ...core.plan import CapturePlan, make_plan
from ...core.ticket import WindowTicket
from ..models import LMConfig, TransformerLM, linen_loss_fn, nnx_init, nnx_loss_fn


@dataclasses.dataclass(frozen=True)
class LMSetup:
    """Abstract params, optimizer state and batch of the benchmark LM on a target."""

    config: LMConfig
    tx: optax.GradientTransformation
    params: dict
    opt_state: object
    batch: dict
    step: jax.ShapeDtypeStruct
    batch_size: int
    loss: Callable  # loss(params, batch)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.config.seq_len

    def train_flops(self) -> float:
        """The standard training estimate, 6 flops per parameter per token plus attention
        (12 x layers x seq x d_model per token); the independent reference for the
        compiler's cost analysis."""
        c = self.config
        return self.tokens_per_step * (6 * c.num_params() + 12 * c.n_layers * c.seq_len * c.d_model)


def lm_setup(target: Target, preset: str, batch_per_device: int = 4, framework: str = "linen") -> LMSetup:
    """The ``preset`` LM (Flax ``"linen"`` or ``"nnx"``) with bfloat16 compute and float32
    Adam state (mixed precision), every leaf sharded over all devices along its first axis
    where it divides (FSDP)."""
    config = LMConfig.preset(preset, dtype="bfloat16")
    tx = optax.adam(1e-4)
    mesh = target.mesh()
    n = len(target.devices)

    def place(x):
        spec = PartitionSpec("fsdp") if x.ndim and x.shape[0] % n == 0 else PartitionSpec()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    shapes, loss = _model(config, framework)
    params = jax.tree.map(place, shapes)
    opt_state = jax.tree.map(place, jax.eval_shape(tx.init, params))
    batch_size = batch_per_device * n
    batch = {"tokens": place(jax.ShapeDtypeStruct((batch_size, config.seq_len + 1), jnp.int32))}
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))
    return LMSetup(config, tx, params, opt_state, batch, step, batch_size, loss)


def _model(config: LMConfig, framework: str) -> tuple[Any, Callable]:
    """Abstract params and ``loss(params, batch)`` of the model in one Flax API."""
    if framework == "linen":
        model = TransformerLM(config)
        tokens = jnp.zeros((1, config.seq_len), jnp.int32)
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens)["params"])
        return shapes, lambda params, batch: linen_loss_fn(model.apply, params, batch)
    if framework == "nnx":
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: nnx_init(config)), nnx.Param)
        return shapes, lambda params, batch: nnx_loss_fn(nnx.merge(graphdef, params), batch)
    raise ValueError(f"framework must be 'linen' or 'nnx', got {framework!r}")


def plan_window(setup: LMSetup, k: int, pack_outbox: bool | None = None) -> CapturePlan:
    """The plan ``OverlapEngine.plan_for`` makes for this state, without its host rehearsal
    (a replay on zeros of the real shapes: 12 GB for the 1B model, and it checks the host
    side, not the device programs compiled here). ``pack_outbox=False``: one copy per leaf,
    as the GPU copy schedule hint plans (``CheckpointManager.jit_compiler_options``)."""
    return make_plan(setup.tx, setup.params, setup.opt_state, None, k,
                     outbox_memory=backend.outbox_memory(backend.HOST_MEMORY), pack_outbox=pack_outbox)


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _train_step(setup: LMSetup, update, compiler_options: dict | None = None):
    shardings = (_shardings(setup.params), _shardings(setup.opt_state))

    def step(params, opt_state, batch, count):
        loss, grads = jax.value_and_grad(setup.loss)(params, batch)
        new_params, new_state, outbox = update(params, opt_state, grads, count)
        new_params, new_state = jax.lax.with_sharding_constraint((new_params, new_state), shardings)
        return new_params, new_state, count + 1, loss, outbox

    in_shardings = (*shardings, _shardings(setup.batch), setup.step.sharding)
    return jax.jit(step, in_shardings=in_shardings, donate_argnums=(0, 1), compiler_options=compiler_options)


def lower_with(setup: LMSetup, compiler_options: dict | None = None):
    """``lower(ticket)`` for :func:`overlap_ckpt.aot.compile_window`; ``compiler_options``:
    those of the step's ``jax.jit``, as a user passes them."""
    def lower(ticket: WindowTicket | None) -> jax.stages.Lowered:
        update = functools.partial(_capture, setup.tx, ticket)
        return _train_step(setup, update, compiler_options).lower(setup.params, setup.opt_state, setup.batch,
                                                                  setup.step)
    return lower


def _capture(tx, ticket, params, opt_state, grads, count):
    return capture_update(tx, ticket, params, opt_state, grads, step=count)


def lower_reference(setup: LMSetup) -> jax.stages.Lowered:
    """The same step with plain optax: what the user compiles without overlap_ckpt."""
    def update(params, opt_state, grads, count):
        updates, new_state = setup.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, None
    return _train_step(setup, update).lower(setup.params, setup.opt_state, setup.batch, setup.step)

