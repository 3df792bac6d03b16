"""The check fails, naming the leaf, on a window program that would stall the step or grow
device memory: a blocking copy over 1 MiB, a donated leaf copied within device memory (also
where the phase stays within the plain step plus its outbox)."""

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


def toy(target, gradient, keep=lambda params: None, shapes=(("w", (512, 1024)),)):
    """A state of f32 leaves ``shapes`` (one 2 MiB leaf by default); ``gradient(w)`` is all
    the compute the step does; window phases also return ``keep(params)`` of the donated
    input (forcing a device copy of it)."""
    device = SingleDeviceSharding(target.devices[0])
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=device) for name, shape in shapes}
    opt_state = jax.eval_shape(TX.init, params)
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=device)
    plan = make_plan(TX, params, opt_state, None, 1, outbox_memory=backend.outbox_memory(backend.HOST_MEMORY))

    def lower(ticket):
        def step(params, opt_state, count):
            grads = jax.tree.map(gradient, params)
            new_params, new_state, outbox = capture_update(TX, ticket, params, opt_state, grads, step=count)
            return new_params, new_state, outbox, (keep(params) if ticket else None)
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, count)

    return compile_window(lower, plan, target)


@pytest.mark.parametrize("target_name", ["h100", TPU_TARGET])
def test_serialized_copy_over_1mib_fails_naming_the_leaf(target_name):
    report = toy(target_or_skip(target_name), jnp.zeros_like)
    with pytest.raises(AotCheckError, match=r"copy of params\['w'\] \(2.0 MiB\) is serialized"):
        report.check()


@pytest.mark.parametrize("target_name", ["h100", TPU_TARGET])
def test_extra_device_copy_fails_naming_the_leaf(target_name):
    report = toy(target_or_skip(target_name), jnp.sin, keep=lambda params: params)
    with pytest.raises(AotCheckError, match=r"params\['w'\] \(2.0 MiB\) is copied within device memory"):
        report.check()


@pytest.mark.parametrize("target_name", ["h100", TPU_TARGET])
def test_device_memory_beyond_outbox_and_layout_fails(target_name):
    """An 8 MiB array the window phases alone return, not a copy of a leaf: 6 MiB more
    than the plain step beyond the 2 MiB outbox, over the fixed 1 MiB layout allowance."""
    report = toy(target_or_skip(target_name), jnp.sin, keep=lambda params: jnp.tile(params["w"], (4, 1)))
    with pytest.raises(AotCheckError, match=r"phase 0: [6-9]\.\d MiB more device memory than the plain step, "
                                            r"beyond its 2\.0 MiB outbox and 1 MiB of layout"):
        report.check()


def test_device_copy_within_the_outbox_allowance_fails_naming_the_leaf():
    """On TPU a leaf over 64 KiB goes to host memory in a copy of its own, so a phase needs
    little device memory beyond the plain step and its outbox allowance is large: a device
    copy of a 2 MiB leaf beside a 32 MiB one stays within it, and is reported on its own."""
    report = toy(target_or_skip(TPU_TARGET), jnp.sin, keep=lambda params: params["w"],
                 shapes=(("big", (8192, 1024)), ("w", (512, 1024))))
    phase = report.phases[0]
    assert phase.memory.peak - report.plain.memory.peak <= phase.memory.host_output, phase.memory
    with pytest.raises(AotCheckError, match=r"params\['w'\] \(2.0 MiB\) is copied within device memory"):
        report.check()


def test_copy_that_overlaps_compute_passes_h100():
    """The same 2 MiB copy with a real gradient to compute beside it passes (h100)."""
    target = target_or_skip("h100")
    report = toy(target, lambda w: jnp.tanh(w @ w.T) @ w)
    assert all(c.overlapped for c in report.phases[0].host_copies), report.phases[0].host_copies
    report.check()
