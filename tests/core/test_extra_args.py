"""core.extra_args: extra update arguments are accepted exactly when optax, run directly,
computes the same update with and without them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from overlap_ckpt.core.extra_args import check_extra_update_args
from overlap_ckpt.errors import UnsupportedOptimizerError

from conftest import make_params


def scale_by_value_when_given() -> optax.GradientTransformationExtraArgs:
    """Reads ``value`` only when it is passed: works without it, so ``prepare`` accepts it."""

    def update(updates, state, params=None, *, value=None, **extra):
        del params, extra
        if value is None:
            return updates, state
        return jax.tree.map(lambda u: u * value, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def scale_by_value_or_one() -> optax.GradientTransformationExtraArgs:
    """The same operations with and without ``value``; only the factor differs."""

    def update(updates, state, params=None, *, value=None, **extra):
        del params, extra
        factor = 1.0 if value is None else value
        return jax.tree.map(lambda u: u * factor, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def doubled_when_value_is_given() -> optax.GradientTransformationExtraArgs:
    """Branches in Python on whether ``value`` is passed, without reading its data."""

    def update(updates, state, params=None, *, value=None, **extra):
        del params, extra
        return (updates if value is None else jax.tree.map(lambda u: 2 * u, updates)), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


IGNORING = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "inject_hyperparams sgd": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
}
USING = {
    "reads value": lambda: optax.chain(scale_by_value_when_given(), optax.adam(1e-2)),
    "same operations, other factor": lambda: optax.chain(scale_by_value_or_one(), optax.sgd(0.1)),
    "branches on value": lambda: optax.chain(doubled_when_value_is_given(), optax.sgd(0.1)),
}


def _bits(tree):
    return [np.asarray(x).reshape(-1).view(np.uint8) for x in jax.tree.leaves(tree)]


def _same_update(tx, grads, state, params, extra) -> bool:
    with_args = tx.update(grads, state, params, **extra)
    without = tx.update(grads, state, params)
    return all(np.array_equal(a, b) for a, b in zip(_bits(with_args), _bits(without)))


@pytest.mark.parametrize("name", [*IGNORING, *USING])
@pytest.mark.parametrize("extra", [{"value": jnp.float32(1.7)}, {"value": 0.5, "note": "python values"}])
def test_accepted_exactly_when_optax_computes_the_same_update(name, extra):
    tx = {**IGNORING, **USING}[name]()
    params = make_params([(8, 3), (3,)])
    grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
    state = tx.init(params)
    same = _same_update(tx, grads, state, params, extra)
    assert same == (name in IGNORING), name  # the reference: optax run directly
    if same:
        check_extra_update_args(tx, grads, state, params, extra)
    else:
        with pytest.raises(UnsupportedOptimizerError, match="value") as info:
            check_extra_update_args(tx, grads, state, params, extra)
        assert "Stop passing them" in str(info.value)


def test_checked_on_tracers_inside_jit_and_a_required_argument_is_refused():
    params = make_params([(8, 3)])
    grads = jax.tree.map(lambda p: 0.1 * p, params)

    def step(value, tx_name):
        tx = {**IGNORING, **USING}[tx_name]()
        check_extra_update_args(tx, grads, tx.init(params), params, {"value": value})
        return value

    step = jax.jit(step, static_argnums=1)
    step(jnp.float32(2.0), "adamw")
    with pytest.raises(UnsupportedOptimizerError):
        step(jnp.float32(2.0), "reads value")
    plateau = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau())
    with pytest.raises(UnsupportedOptimizerError, match="value"):
        check_extra_update_args(plateau, grads, plateau.init(params), params, {"value": jnp.float32(1.0)})
