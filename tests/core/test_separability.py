"""core.separability: which optimizer-state leaf belongs to which parameter, the global
scalars, chunkability, and the refusals (with the leaves they name)."""

import jax
import jax.numpy as jnp
import optax
import pytest

from overlap_ckpt import InternalError, MemorySink, OverlapEngine, UnsupportedOptimizerError
from overlap_ckpt.core.separability import analyze_update, optax_update_fn

from conftest import make_params


def analyze(tx, params):
    return analyze_update(optax_update_fn(tx), params, tx.init(params))


def test_adam_owners_and_shared_count():
    params = make_params([(4, 3), (3,)])
    a = analyze(optax.adam(1e-2), params)
    # opt_state leaves: count, mu[w000], mu[w001], nu[w000], nu[w001]
    assert a.state_owner == (None, 0, 1, 0, 1) and a.shared_state == [0]
    assert a.chunkable and a.n_globals == 0


def test_clip_by_global_norm_ships_the_scalars_its_update_reads():
    params = make_params([(4, 3), (3,)])
    a = analyze(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), params)
    # Global scalars: one sum of squares per leaf, the scalar arithmetic on them, the test.
    assert [p for p, _ in a.cut_signature] == ["reduce_sum", "reduce_sum", "add", "add", "sqrt", "copy", "lt"]
    # Shipped: what the leaves' update reads (the norm it divides by, the test it selects
    # on); the sums are only read by the arithmetic that makes those.
    assert a.chunkable and a.shipped_signature == (("copy", "float32"), ("lt", "bool"))
    assert a.n_globals == 2


def test_adafactor_needs_whole_leaves():
    params = make_params([(256, 192)])
    a = analyze(optax.adafactor(1e-2), params)
    assert not a.chunkable and "reduces within a leaf" in a.why_not_chunkable


@pytest.mark.parametrize("name", ["prodigy", "cocob", "dowg"])
def test_frozen_initial_params_belong_to_their_parameter(name):
    """prodigy, cocob and dowg keep a copy of the initial params that the update only reads
    (p0 - p): it must be sliced with its parameter, not shipped whole as shared state."""
    tx = getattr(optax.contrib, name)()
    params = make_params([(4, 3), (3,)])
    a = analyze(tx, params)
    state_shapes = [x.shape for x in jax.tree.leaves(tx.init(params))]
    shared_shapes = [state_shapes[j] for j in a.shared_state]
    assert (4, 3) not in shared_shapes and (3,) not in shared_shapes, shared_shapes


def test_flattening_optimizer_is_refused_with_leaf_names():
    def mixing():
        def update(updates, state, params=None):
            flat = jnp.concatenate([u.ravel() for u in jax.tree.leaves(updates)])
            flat = flat - jnp.mean(flat)  # whitening over the concatenated vector
            out, i = [], 0
            for u in jax.tree.leaves(updates):
                out.append(flat[i:i + u.size].reshape(u.shape))
                i += u.size
            return jax.tree.unflatten(jax.tree.structure(updates), out), state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    engine = OverlapEngine(mixing(), MemorySink(), interval=4, window=2)
    params = make_params([(4, 3), (3,)])
    with pytest.raises(UnsupportedOptimizerError, match=r"params\['w00[01]'\]"):
        engine.plan_for(params, engine.tx.init(params))
    engine.close()


def test_optimizer_failing_on_the_tree_is_refused_by_name():
    params = make_params([(4, 3)])
    tx = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    engine = OverlapEngine(tx, MemorySink(), interval=4, window=2)
    with pytest.raises(UnsupportedOptimizerError) as info:
        engine.plan_for(params, tx.init(optax.LookaheadParams.init_synced(params)))
    message = str(info.value)
    assert "lookahead" in message.lower() and len(message) < 2000, message
    engine.close()


def test_missing_jax_api_is_our_fault_not_the_optimizers(monkeypatch):
    """An API missing from an old jax (jax.extend.core.jaxprs_in_params appeared in 0.10.0)
    must not be reported as an unsupported optimizer: plain adamw is fine."""
    import jax.extend.core as jcore

    monkeypatch.delattr(jcore, "jaxprs_in_params")
    tx = optax.adamw(1e-3)
    engine = OverlapEngine(tx, MemorySink(), interval=4, window=2)
    params = make_params([(4, 3), (3,)])
    with pytest.raises(InternalError) as info:
        engine.plan_for(params, tx.init(params))
    engine.close()
    assert not isinstance(info.value, UnsupportedOptimizerError)
    message = str(info.value)
    assert "jaxprs_in_params" in message and "not a fault of your optimizer" in message, message
    assert "jax " in message and "pyproject.toml" in message, message


def test_optimizer_raising_on_its_own_is_still_refused():
    def broken():
        def update(updates, state, params=None):
            raise TypeError("this optimizer needs a learning-rate argument")
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    params = make_params([(4, 3)])
    with pytest.raises(UnsupportedOptimizerError, match="learning-rate argument"):
        analyze(broken(), params)


def test_failure_of_our_host_replay_is_internal_and_not_retried(monkeypatch):
    """The rehearsal of the host replay (at plan time) runs our interpreter in inject mode:
    when that breaks while the optimizer runs fine on the same slices, the fault is ours,
    reported as such, and not hidden by falling back to whole-leaf slices."""
    from overlap_ckpt.core import interp

    finish = interp.Interpreter.finish

    def broken_finish(self):
        if self.mode == "inject":
            raise KeyError("planted fault in the host replay")
        return finish(self)

    monkeypatch.setattr(interp.Interpreter, "finish", broken_finish)
    tx = optax.adam(1e-2)
    engine = OverlapEngine(tx, MemorySink(), interval=4, window=2)
    params = make_params([(4, 3), (3,)])
    with pytest.raises(InternalError, match="planted fault in the host replay") as info:
        engine.plan_for(params, tx.init(params))
    engine.close()
    assert "rehearsing the host replay" in str(info.value)
