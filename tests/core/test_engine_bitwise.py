"""The replayed checkpoint at V equals a synchronous snapshot at V, bit for bit (CPU)."""

import jax
import jax.numpy as jnp
import optax
import pytest

import os
import re

from overlap_ckpt.core.separability import KNOWN_EXACT_OPTIMIZERS

from conftest import REPO, assert_within_ulps, check_windows, make_params, run_loop

MIXED = ((37, 5), (5,), (300, 16), (), (3, 4, 6))


def _mask(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_nesterov": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw_warmup_cosine_masked": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 60), weight_decay=0.1, mask=_mask),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "multisteps4": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4),
    "inject_adamw": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "lamb": lambda: optax.lamb(1e-2),
}


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_mixed_tree(name, window):
    _, sink, refs = run_loop(OPTIMIZERS[name](), make_params(MIXED), window=window, interval=6, steps=18)
    check_windows(sink, refs)


@pytest.mark.parametrize("window", [2, 7])
@pytest.mark.parametrize("name", ["adam", "clip_adamw", "adafactor", "adamw_warmup_cosine_masked"])
def test_more_windows(name, window):
    _, sink, refs = run_loop(OPTIMIZERS[name](), make_params(MIXED), window=window, interval=7, steps=14)
    check_windows(sink, refs)


@pytest.mark.parametrize("window", [1, 2, 3, 7])
def test_single_leaf_split_into_row_chunks(window):
    engine, sink, refs = run_loop(optax.adam(1e-2), make_params([(64, 33)]), window=window, interval=8, steps=16)
    check_windows(sink, refs)
    assert engine.plan.k == window and engine.plan.chunked


def test_two_leaves_clip_active_on_some_steps():
    # A threshold between the gradient norms seen in the run: clipping on some steps only.
    params = make_params([(40, 8), (17,)])
    _, sink, refs = run_loop(optax.chain(optax.clip_by_global_norm(3.0), optax.adam(1e-2)), params,
                             window=3, interval=5, steps=15)
    check_windows(sink, refs)


MANY = [((i % 13) + 1, (i % 7) + 2) for i in range(200)] + [(500, 12)]


@pytest.mark.parametrize("name,window", [("clip_adamw", 3)])
def test_many_leaves(name, window):
    # 201 leaves, one larger than a slice, global scalars, a multi-phase replay; one
    # window (compiling 201-leaf programs for every phase dominates the time on CPU;
    # K=7 is covered on the mixed and single-leaf trees).
    engine, sink, refs = run_loop(OPTIMIZERS[name](), make_params(MANY), window=window,
                                  interval=window, steps=window + 1)
    check_windows(sink, refs)
    assert engine.plan.k == window and len(refs) == 1


@pytest.mark.parametrize("window", [1, 3])
def test_uncommitted_initial_state(window):
    """The state as ``jnp.asarray`` and a jitted init leave it (uncommitted), as a user's
    first step gets it: the first window's plain and phase-0 programs are compiled for it,
    later ones for the committed state the window steps return; both replay exactly."""
    _, sink, refs = run_loop(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
                             make_params(MIXED), window=window, interval=4, steps=9, committed=False)
    check_windows(sink, refs)


def test_adafactor_factored_leaves_whole_leaf_slices():
    params = make_params([(256, 160), (160,), (130, 300)])
    engine, sink, refs = run_loop(optax.adafactor(1e-2), params, window=3, interval=3, steps=6)
    check_windows(sink, refs)
    assert not engine.plan.chunked


def test_apply_if_finite_with_injected_nan_step():
    tx = optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3)
    _, sink, refs = run_loop(tx, make_params(MIXED), window=3, interval=6, steps=18, nan_step=10)
    check_windows(sink, refs)


def test_nan_gradients_without_policy_replay_as_nan():
    _, sink, refs = run_loop(optax.adam(1e-2), make_params(MIXED), window=3, interval=6, steps=12, nan_step=5)
    check_windows(sink, refs)


@pytest.mark.parametrize("window", [1, 3])
def test_bf16_params(window):
    _, sink, refs = run_loop(optax.adamw(1e-2), make_params(MIXED, dtype=jnp.bfloat16),
                             window=window, interval=6, steps=12)
    check_windows(sink, refs)


def test_whole_leaf_slicing_forced():
    engine, sink, refs = run_loop(optax.adam(1e-2), make_params(MIXED), window=3, interval=6, steps=12,
                                  chunk_leaves=False)
    check_windows(sink, refs)
    assert not engine.plan.chunked


MORE = {
    "rmsprop": lambda: optax.rmsprop(1e-3),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adabelief": lambda: optax.adabelief(1e-3),
    "lars": lambda: optax.lars(1e-3),
    "prodigy": lambda: optax.contrib.prodigy(),
    "cocob": lambda: optax.contrib.cocob(),
    "dowg": lambda: optax.contrib.dowg(),
    "adaptive_grad_clip_sgd": lambda: optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(0.1)),
    "ema_sgd": lambda: optax.chain(optax.ema(0.9), optax.sgd(0.1)),
    "clip_adam": lambda: optax.chain(optax.clip(0.1), optax.adam(1e-3)),
    "nadamw": lambda: optax.nadamw(1e-2, weight_decay=0.1),
    "radam": lambda: optax.radam(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    "adan": lambda: optax.adan(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "adamax": lambda: optax.adamax(1e-2),
    # Scalars (learning rates, bias corrections) that only some leaves read: the host replay
    # keeps apart those several leaves read (see ReplayPrograms), whichever leaves a call has.
    "multi_transform_adamw_sgd": lambda: optax.multi_transform(
        {"matrix": optax.adamw(1e-2), "other": optax.sgd(0.1, momentum=0.5)},
        lambda params: jax.tree.map(lambda x: "matrix" if x.ndim > 1 else "other", params)),
    # Per-leaf norms cut inside a lax.cond: the replay's branch outputs what the device's ships.
    "novograd": lambda: optax.novograd(1e-2),
    # A cond with cuts inside another cond's branch: the outer replay branch outputs the
    # inner cond's slot outputs, where the device's outputs what the inner cond recorded.
    "multisteps_novograd": lambda: optax.MultiSteps(optax.novograd(1e-2), every_k_schedule=2),
    "apply_if_finite_novograd": lambda: optax.apply_if_finite(optax.novograd(1e-2), max_consecutive_errors=3),
    # A moment of a gradient clipped by its global norm inside MultiSteps' cond: the update
    # reads the norm through a barrier on both sides (capture.cut_barrier).
    "multisteps_clip_adamw": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), every_k_schedule=2),
    "multisteps_clip_trace": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.5), optax.trace(0.9)), every_k_schedule=2),
    "multisteps_clip_lion": lambda: optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.5), optax.lion(1e-3)), every_k_schedule=2),
    "apply_if_finite_multisteps_clip_adamw": lambda: optax.apply_if_finite(optax.MultiSteps(
        optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), every_k_schedule=2), max_consecutive_errors=3),
    # Newer optimizers users reach for: schedule-free averaging, a third moment, per-step
    # learning rates learnt from global sums (dadapt, mechanize), sign-based step sizes.
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=3),
    "ademamix": lambda: optax.contrib.ademamix(1e-2),
    "adopt": lambda: optax.contrib.adopt(1e-2),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
    "mechanize_adam": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
    "madgrad": lambda: optax.contrib.madgrad(1e-2),
    "optimistic_adam_v2": lambda: optax.optimistic_adam_v2(1e-2),
    "rprop": lambda: optax.rprop(1e-2),
}


@pytest.mark.parametrize("name", sorted(MORE))
def test_documented_optimizers(name):
    """Every optimizer docs/optimizers.md lists as exact is checked bitwise here."""
    _, sink, refs = run_loop(MORE[name](), make_params(MIXED), window=3, interval=4, steps=9)
    check_windows(sink, refs)


def test_muon_within_the_ulp_bound():
    """Newton-Schulz matrix products: XLA:CPU may emit the host's dots differently, so the
    replay is within a few ulp (documented), not bitwise."""
    _, sink, refs = run_loop(optax.contrib.muon(1e-3), make_params(MIXED), window=3, interval=4, steps=9)
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert_within_ulps((tree["params"], tree["opt_state"]), ref, f"version {version}")


# docs/optimizers.md row -> the test that checks it bitwise (keys of OPTIMIZERS or MORE)
DOC_ROWS = {
    "sgd": "sgd", "sgd(momentum, nesterov)": "sgd_nesterov", "adam": "adam",
    "adamw(warmup_cosine, mask)": "adamw_warmup_cosine_masked", "lion": "lion", "rmsprop": "rmsprop",
    "adagrad": "adagrad", "adabelief": "adabelief", "lamb": "lamb", "lars": "lars", "adafactor": "adafactor",
    "chain(clip_by_global_norm, adamw)": "clip_adamw", "chain(clip(0.1), adam)": "clip_adam",
    "apply_if_finite(adam)": "apply_if_finite", "MultiSteps(adam, 4)": "multisteps4",
    "inject_hyperparams(adamw)": "inject_adamw", "chain(adaptive_grad_clip, sgd)": "adaptive_grad_clip_sgd",
    "chain(ema, sgd)": "ema_sgd", "contrib.prodigy": "prodigy", "contrib.cocob": "cocob", "contrib.dowg": "dowg",
    "nadamw": "nadamw", "radam": "radam", "yogi": "yogi", "adan": "adan", "amsgrad": "amsgrad", "adamax": "adamax",
    "multi_transform(adamw, sgd(momentum))": "multi_transform_adamw_sgd", "novograd": "novograd",
    "MultiSteps(novograd, 2)": "multisteps_novograd", "apply_if_finite(novograd)": "apply_if_finite_novograd",
    "MultiSteps(chain(clip_by_global_norm, adamw), 2)": "multisteps_clip_adamw",
    "MultiSteps(chain(clip_by_global_norm, trace), 2)": "multisteps_clip_trace",
    "MultiSteps(chain(clip_by_global_norm, lion), 2)": "multisteps_clip_lion",
    "apply_if_finite(MultiSteps(chain(clip_by_global_norm, adamw), 2))": "apply_if_finite_multisteps_clip_adamw",
    "contrib.schedule_free_adamw": "schedule_free_adamw", "contrib.ademamix": "ademamix", "contrib.adopt": "adopt",
    "contrib.dadapt_adamw": "dadapt_adamw", "contrib.mechanize(adam)": "mechanize_adam", "contrib.madgrad": "madgrad",
    "optimistic_adam_v2": "optimistic_adam_v2", "rprop": "rprop",
}


def test_docs_table_the_known_list_and_these_tests_agree():
    text = open(os.path.join(REPO, "docs", "optimizers.md"), encoding="utf-8").read()
    exact = set(re.findall(r"^\| `([^`]+)` \| exact \|", text, flags=re.M))
    assert exact == set(DOC_ROWS), exact ^ set(DOC_ROWS)
    assert set(DOC_ROWS.values()) <= set(OPTIMIZERS) | set(MORE) | {"apply_if_finite"}
    for name in KNOWN_EXACT_OPTIMIZERS:
        assert any(name in row for row in exact), f"{name} is known-exact but has no exact row in the docs"
