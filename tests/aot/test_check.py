"""The check fails, naming the leaf, on a window program that would stall the step or grow
device memory: a blocking copy over 1 MiB, a donated leaf copied within device memory."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import SingleDeviceSharding

from overlap_ckpt.aot import AotCheckError, compile_window
from overlap_ckpt.core import backend
from overlap_ckpt.core.capture import capture_update
from overlap_ckpt.core.plan import make_plan

from .conftest import TPU_TARGET, target_or_skip

TX = optax.sgd(0.1)


def toy(target, gradient, keep_input: bool):
    """A 2 MiB one-leaf state; ``gradient(w)`` is all the compute the step does;
    ``keep_input``: window phases also return the donated input (forcing a device copy)."""
    device = SingleDeviceSharding(target.devices[0])
    params = {"w": jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=device)}
    opt_state = jax.eval_shape(TX.init, params)
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=device)
    plan = make_plan(TX, params, opt_state, None, 1, outbox_memory=backend.outbox_memory(backend.HOST_MEMORY))

    def lower(ticket):
        def step(params, opt_state, count):
            grads = jax.tree.map(gradient, params)
            new_params, new_state, outbox = capture_update(TX, ticket, params, opt_state, grads, step=count)
            return new_params, new_state, outbox, (params if keep_input and ticket else None)
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, count)

    return compile_window(lower, plan, target)


@pytest.mark.parametrize("target_name", ["h100", TPU_TARGET])
def test_serialized_copy_over_1mib_fails_naming_the_leaf(target_name):
    report = toy(target_or_skip(target_name), jnp.zeros_like, keep_input=False)
    with pytest.raises(AotCheckError, match=r"copy of params\['w'\] \(2.0 MiB\) is serialized"):
        report.check()


@pytest.mark.parametrize("target_name", ["h100", TPU_TARGET])
def test_extra_device_copy_fails_naming_the_leaf(target_name):
    report = toy(target_or_skip(target_name), jnp.sin, keep_input=True)
    with pytest.raises(AotCheckError, match=r"more device memory than the plain step.*params\['w'\]"):
        report.check()


def test_copy_that_overlaps_compute_passes_h100():
    """The same 2 MiB copy with a real gradient to compute beside it passes (h100)."""
    target = target_or_skip("h100")
    report = toy(target, lambda w: jnp.tanh(w @ w.T) @ w, keep_input=False)
    assert all(c.overlapped for c in report.phases[0].host_copies), report.phases[0].host_copies
    report.check()
