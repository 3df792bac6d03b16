"""Out-of-graph capture around an opaque step function."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

from overlap_ckpt import MemorySink, OverlapEngine
from overlap_ckpt.core.fallback import capture_after, capture_before

from conftest import check_windows, make_params, toy_loss

MIXED = ((37, 5), (5,), (300, 16), ())


def _loop(tx, *, window, donate, steps=13, interval=6):
    params = make_params(MIXED)
    opt_state = tx.init(params)
    sink = MemorySink()
    engine = OverlapEngine(tx, sink, interval=interval, window=window)
    engine.plan_for(params, opt_state, {"step": jnp.int32(0)})
    grad_fn = jax.jit(jax.grad(toy_loss))

    # An opaque user step: gradients, then the update as a program of its own.
    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def apply(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    refs = {}
    for t in range(steps):
        ticket = engine.ticket(t)
        x = jnp.float32(0.1 + 0.01 * t)
        if ticket is not None:
            outbox = capture_before(ticket, params, opt_state, {"step": jnp.int32(t)})
        grads = grad_fn(params, x)
        inputs = None if donate else (params, opt_state)
        new_params, new_state = apply(params, opt_state, grads)
        if ticket is not None:
            outbox = capture_after(outbox, grads, *(inputs or (None, None)))
            engine.submit(t, outbox)
        params, opt_state = new_params, new_state
        if (t + 1) % interval == 0 and t + 1 < steps:
            refs[t + 1] = jax.device_get((params, opt_state))
    engine.wait_until_finished()
    engine.close()
    return sink, refs


@pytest.mark.parametrize("window", [1, 3])
def test_fallback_with_donation_is_exact(window):
    sink, refs = _loop(optax.adam(1e-2), window=window, donate=True)
    check_windows(sink, refs)


def test_fallback_with_global_scalars_needs_live_inputs():
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    sink, refs = _loop(tx, window=3, donate=False)
    check_windows(sink, refs)
    with pytest.raises(ValueError, match="global scalars"):
        _loop(tx, window=3, donate=True)
