"""Tests for overlap_ckpt.tools.models: param-count formula, learning, bitwise determinism,
synthetic data purity and dropout plumbing. Compiles dominate: each test shares compiled
programs where it can, and the cross-process child runs alongside the other tests."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import REPO
from overlap_ckpt.tools.models import (
    LMConfig,
    NNXTransformerLM,
    SyntheticTokens,
    TransformerLM,
    linen_init,
    linen_loss_fn,
    nnx_init,
    nnx_loss_fn,
)

TINY = LMConfig.preset("tiny")
BATCH = 8
STEPS = 30
LR = 1e-2


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", ["tiny", "small", "20m"])
@pytest.mark.parametrize("tie", [True, False])
def test_num_params_matches_linen(name: str, tie: bool) -> None:
    cfg = LMConfig.preset(name, tie_embeddings=tie)
    shapes = jax.eval_shape(lambda k: linen_init(cfg, k), jax.random.key(0))
    assert _count(shapes) == cfg.num_params()


@pytest.mark.parametrize("name", ["tiny", "small", "20m"])
@pytest.mark.parametrize("tie", [True, False])
def test_num_params_matches_nnx(name: str, tie: bool) -> None:
    cfg = LMConfig.preset(name, tie_embeddings=tie)
    model = nnx.eval_shape(lambda: nnx_init(cfg, 0))
    assert _count(nnx.state(model, nnx.Param)) == cfg.num_params()
    # With dropout off the model carries no RNG state: its state is exactly its params.
    assert _count(nnx.state(model)) == cfg.num_params()


def test_presets_sizes() -> None:
    expected = {"tiny": 0.2e6, "small": 2e6, "20m": 20e6, "100m": 100e6, "1b": 1e9}
    for name, target in expected.items():
        n = LMConfig.preset(name).num_params()
        assert 0.8 * target <= n <= 1.25 * target, (name, n)
    mib = LMConfig.preset("20m").adam_state_bytes() / 2**20
    assert 220 <= mib <= 260
    assert LMConfig.preset("tiny", param_dtype="bfloat16").param_bytes() == 2 * TINY.num_params()


def test_config_validation_and_replace() -> None:
    with pytest.raises(ValueError):
        LMConfig.preset("nope")
    with pytest.raises(ValueError):
        TINY.replace(n_heads=3)
    with pytest.raises(ValueError):
        TINY.replace(dtype="float16")
    assert TINY.replace(n_layers=1).n_layers == 1
    assert hash(TINY) == hash(LMConfig.preset("tiny"))  # usable as a static jit arg


# ----------------------------------------------------------------------------- data


def test_batch_is_pure_function_of_seed_and_step() -> None:
    a = SyntheticTokens(512, 64, BATCH, seed=3)
    b = SyntheticTokens(512, 64, BATCH, seed=3)
    x = a.batch(7)["tokens"]
    assert x.dtype == np.int32 and x.shape == (BATCH, 65)
    assert x.min() >= 0 and x.max() < 512
    np.testing.assert_array_equal(x, b.batch(7)["tokens"])
    np.testing.assert_array_equal(x, a.batch(7)["tokens"])  # no hidden iterator state
    assert not np.array_equal(x, a.batch(8)["tokens"])
    assert not np.array_equal(x, SyntheticTokens(512, 64, BATCH, seed=4).batch(7)["tokens"])
    it = a.iterate(start_step=5)
    for step in (5, 6, 7):
        np.testing.assert_array_equal(next(it)["tokens"], a.batch(step)["tokens"])


def test_batch_follows_the_markov_chain() -> None:
    data = SyntheticTokens(512, 64, BATCH, seed=0)
    tokens = data.batch(0)["tokens"]
    succ = data._successors
    prev, nxt = tokens[:, :-1].ravel(), tokens[:, 1:].ravel()
    assert np.all((succ[prev] == nxt[:, None]).any(axis=1))
    assert 0.0 < data.entropy_rate() < math.log(512) / 2


# ----------------------------------------------------------------------------- training

_tx = optax.adam(LR)
_linen_model = TransformerLM(TINY)


@jax.jit
def _linen_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(_linen_model.apply, p, batch))(params)
    updates, opt_state = _tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@nnx.jit
def _nnx_step(model: NNXTransformerLM, optimizer: nnx.Optimizer, batch) -> jax.Array:
    loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _run_linen(steps: int = STEPS) -> tuple[np.ndarray, dict]:
    data = SyntheticTokens(TINY.vocab_size, TINY.seq_len, BATCH, seed=0)
    params = linen_init(TINY, jax.random.key(0))
    opt_state = _tx.init(params)
    losses = []
    for step in range(steps):
        params, opt_state, loss = _linen_step(params, opt_state, data.batch(step))
        losses.append(loss)
    return np.asarray(jax.device_get(losses)), jax.device_get(params)


def _run_nnx(steps: int = STEPS) -> tuple[np.ndarray, dict]:
    data = SyntheticTokens(TINY.vocab_size, TINY.seq_len, BATCH, seed=0)
    model = nnx_init(TINY, seed=0)
    optimizer = nnx.Optimizer(model, _tx, wrt=nnx.Param)
    losses = [_nnx_step(model, optimizer, data.batch(step)) for step in range(steps)]
    return np.asarray(jax.device_get(losses)), jax.device_get(nnx.to_pure_dict(nnx.state(model)))


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module", autouse=True)
def child_process():
    """Output lines of a separate Python process that prints one synthetic batch and the
    losses of a 3-step Linen run (as hex bytes). Started with the module's first test so
    its compiles overlap with the in-process tests (compiles dominate the wall time);
    killed at module teardown if still running."""
    code = textwrap.dedent(
        """
        import sys
        sys.path[:0] = [{tests_dir!r}, {root_tests!r}]
        import test_models as t
        print(t.SyntheticTokens(512, 64, 8, seed=3).batch(11)["tokens"].tobytes().hex(), flush=True)
        print(t._run_linen(3)[0].tobytes().hex())
        """
    ).format(tests_dir=os.path.dirname(os.path.abspath(__file__)), root_tests=os.path.join(REPO, "tests"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_subprocess_env())
    result: list[str] = []

    def lines() -> list[str]:
        if not result:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            result.extend(out.split())
        return result

    yield lines
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def linen_runs():
    return _run_linen(), _run_linen()


@pytest.fixture(scope="module")
def nnx_runs():
    return _run_nnx(), _run_nnx()


def _assert_learns(losses: np.ndarray) -> None:
    assert np.all(np.isfinite(losses))
    assert abs(losses[0] - math.log(TINY.vocab_size)) < 0.1  # starts near uniform
    assert losses[-5:].mean() < losses[0] - 0.5, losses


def _assert_bitwise_equal(run_a, run_b) -> None:
    (losses_a, params_a), (losses_b, params_b) = run_a, run_b
    assert losses_a.tobytes() == losses_b.tobytes()
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_linen_loss_decreases(linen_runs) -> None:
    _assert_learns(linen_runs[0][0])


def test_nnx_loss_decreases(nnx_runs) -> None:
    _assert_learns(nnx_runs[0][0])


def test_linen_runs_bitwise_identical(linen_runs) -> None:
    _assert_bitwise_equal(*linen_runs)


def test_nnx_runs_bitwise_identical(nnx_runs) -> None:
    _assert_bitwise_equal(*nnx_runs)


# ----------------------------------------------------------------------------- model details


def test_linen_nnx_same_param_shapes() -> None:
    linen_shapes = jax.eval_shape(lambda k: linen_init(TINY, k), jax.random.key(0))
    nnx_model = nnx.eval_shape(lambda: nnx_init(TINY))
    sizes = lambda tree: sorted(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    assert sizes(linen_shapes) == sizes(nnx.state(nnx_model, nnx.Param))


def test_causal_short_sequences_and_bfloat16_compute() -> None:
    bf16_params = jax.eval_shape(lambda k: linen_init(TINY.replace(param_dtype="bfloat16"), k),
                                 jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16_params))
    bf16 = TINY.replace(dtype="bfloat16")  # bf16 compute, float32 params (shared with TINY)
    params = linen_init(TINY, 0)
    tokens = SyntheticTokens(TINY.vocab_size, 16, 2, seed=1).batch(0)["tokens"]  # T=16 < seq_len
    changed = tokens.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % TINY.vocab_size

    @jax.jit
    def run(p):  # one compiled program for all checks (compiles dominate test time)
        logits = TransformerLM(TINY).apply({"params": p}, jnp.concatenate([tokens, changed])[:, :-1])
        return logits, linen_loss_fn(TransformerLM(bf16).apply, p, {"tokens": tokens})

    logits, bf16_loss = run(params)
    assert logits.shape == (4, 16, TINY.vocab_size)
    np.testing.assert_array_equal(logits[:2, :10], logits[2:, :10])  # no peeking ahead
    assert not np.array_equal(logits[:2, 10:], logits[2:, 10:])
    assert bf16_loss.dtype == jnp.float32 and np.isfinite(bf16_loss)
    with pytest.raises(ValueError):
        jax.eval_shape(TransformerLM(TINY).apply, {"params": params},
                       jnp.zeros((1, TINY.seq_len + 1), jnp.int32))


def test_linen_dropout() -> None:
    cfg = TINY.replace(dropout_rate=0.2)
    params = linen_init(cfg, 0)  # dropout has no params: same compiled init as TINY
    apply = TransformerLM(cfg).apply
    batch = SyntheticTokens(cfg.vocab_size, 32, 2, seed=0).batch(0)

    @jax.jit
    def run(p, key):
        loss_and_grad = jax.value_and_grad(lambda q: linen_loss_fn(apply, q, batch, rngs={"dropout": key}))
        loss, grads = loss_and_grad(p)
        return loss, grads, linen_loss_fn(apply, p, batch)  # rngs=None: eval mode, no rng needed

    k1, k2 = jax.random.split(jax.random.key(1))
    (loss1, grads, eval1), (loss2, _, eval2), (loss1b, _, _) = (run(params, k) for k in (k1, k2, k1))
    assert loss1 == loss1b != loss2  # same key -> same mask; new key -> new mask
    assert eval1 == eval2 != loss1
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


def test_nnx_dropout() -> None:
    cfg = TINY.replace(dropout_rate=0.2, n_layers=1)
    batch = SyntheticTokens(cfg.vocab_size, 32, 2, seed=0).batch(0)
    model, twin = nnx_init(cfg, seed=0), nnx_init(cfg, seed=0)
    assert _count(nnx.state(model, nnx.RngState)) > 0  # dropout stream is model state
    loss_fn = nnx.jit(nnx_loss_fn)

    first = loss_fn(model, batch)
    assert np.isfinite(first)
    assert first == loss_fn(twin, batch)  # same seeds -> same masks
    assert loss_fn(model, batch) != first  # the stream advanced inside the model
    model.eval()  # standard NNX switch: every dropout site becomes deterministic
    assert all(m.deterministic for _, m in nnx.iter_modules(model)
               if isinstance(m, (nnx.Dropout, nnx.MultiHeadAttention)))


# ----------------------------------------------------------------------------- other process
# (last in the file: they wait for the child process started by ``child_process``)


def test_batch_identical_across_processes(child_process) -> None:
    expected = SyntheticTokens(512, 64, 8, seed=3).batch(11)["tokens"].tobytes().hex()
    assert child_process()[0] == expected


def test_linen_run_bitwise_identical_across_processes(linen_runs, child_process) -> None:
    # What a resume-in-a-new-process comparison relies on: a fresh process, which
    # recompiles everything, reproduces the first steps bit for bit.
    assert child_process()[1] == linen_runs[0][0][:3].tobytes().hex()
