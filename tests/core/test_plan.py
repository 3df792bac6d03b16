"""core.plan: layouts of leaves, plans that compare by value, the state pieces of a slice."""

import jax
import jax.numpy as jnp
import optax
import pytest

from overlap_ckpt.core.plan import leaf_layout, make_plan
from overlap_ckpt.core.slicing import Piece
from overlap_ckpt.errors import UnsupportedOptimizerError

from conftest import make_params


def test_equal_states_and_the_same_optimizer_give_equal_plans():
    tx = optax.adam(1e-2)
    params = make_params([(8, 3), (3,)])
    a = make_plan(tx, params, tx.init(params), {"step": jnp.int32(0)}, 2)
    b = make_plan(tx, make_params([(8, 3), (3,)], seed=1), tx.init(params), {"step": jnp.int32(5)}, 2)
    assert a is not b and a == b and hash(a) == hash(b)  # a jit cache hit, not a recompile
    assert a != make_plan(optax.adam(1e-2), params, tx.init(params), {"step": jnp.int32(0)}, 2)  # another tx
    assert a != make_plan(tx, params, tx.init(params), {"step": jnp.int32(0)}, 1)
    assert len(repr(a)) < 200


def test_typed_prng_keys_are_refused_by_where_they_are():
    """A key in the optimizer state (optax.noisy_sgd) cannot be replayed: refused, naming the
    leaf; a key in extras is refused with the conversion the doors do (numpy has no dtype
    for it, and the first thing planning reads is the dtype)."""
    params = make_params([(8, 3)])
    noisy = optax.noisy_sgd(1e-2, key=jax.random.key(0))
    with pytest.raises(UnsupportedOptimizerError, match=r"opt_state\[0\]\.rng_key"):
        make_plan(noisy, params, noisy.init(params), None, 2)
    adam = optax.adam(1e-2)
    with pytest.raises(TypeError, match=r"extras\['dropout'\].*key_data"):
        make_plan(adam, params, adam.init(params), {"dropout": jax.random.key(1)}, 2)
    make_plan(adam, params, adam.init(params), {"dropout": jax.random.key_data(jax.random.key(1))}, 2)


def test_matches_names_the_changed_leaf():
    tx = optax.sgd(0.1)
    params = make_params([(8, 3)])
    plan = make_plan(tx, params, tx.init(params), None, 1)
    assert plan.matches(params, tx.init(params), None) is None
    wider = make_params([(8, 4)])
    assert "(8, 4)" in plan.matches(wider, tx.init(wider), None).why


def test_state_piece_follows_the_parameter_rows():
    tx = optax.adam(1e-2)
    params = make_params([(8, 3)])
    plan = make_plan(tx, params, tx.init(params), None, 2)
    mu = plan.analysis.owned_state(0)[0]
    assert plan.state_piece(mu, Piece(0, 2, 5)) == Piece(mu, 2, 5)
    assert plan.state_piece(mu, Piece(0, 0, 8)) == Piece(mu, 0, plan.state[mu].rows)


def test_abstract_leaf_on_one_device_has_one_block():
    device = jax.devices()[0]
    layout = leaf_layout(jax.ShapeDtypeStruct((5, 2), jnp.float32,
                                              sharding=jax.sharding.SingleDeviceSharding(device)))
    assert layout.blocks == ((slice(0, 5), slice(0, 2)),) and layout.rows == 5


def test_large_leaves_are_cut_at_coarse_rows_by_slices_and_replay_calls():
    """The rows each replay call keeps become storage parts: a leaf of 4 MiB or more is cut
    at multiples of 1 MiB of rows (here 256 rows of 4 KiB), so that storage chunks tile the
    parts and TensorStore writes them without copies; small leaves keep row cuts."""
    from overlap_ckpt.core.replay import ReplayPrograms

    tx = optax.adam(1e-3)
    # 4096 rows: the replayed slices (0.57 of the rows) take several replay calls each
    params = make_params([(4096, 1024), (40, 6)])
    plan = make_plan(tx, params, tx.init(params), {}, 3)
    assert plan.chunked and plan.k == 3
    cuts = {p.leaf: [] for s in plan.slicing.slices for p in s}
    for piece in (p for s in plan.slicing.slices for p in s):
        cuts[piece.leaf] += [piece.start, piece.stop]
    assert len(cuts[0]) > 2 and all(c % 256 == 0 for c in cuts[0]), cuts[0]
    programs = ReplayPrograms(plan)
    kept = [c.keep for i in range(plan.k - 1) for batch in programs.slice_batches(i) for c in batch
            if c.keep.leaf == 0 and c.keep.stop > c.keep.start]
    assert len(kept) > 2 and all(r.start % 256 == 0 and r.stop % 256 == 0 for r in kept), kept
