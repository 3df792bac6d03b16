"""The accelerator-only branches, run on the CPU backend through overlap_ckpt.testing:
isolation by optimization barrier, window="auto" choosing K from measurements, window
copies in another memory kind. (The GPU runs themselves need a GPU.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import overlap_ckpt as oc
from overlap_ckpt import costmodel
from overlap_ckpt.costmodel.window import MFU
from overlap_ckpt.manager.window_choice import MEASURE_STEPS
from overlap_ckpt.aot.targets import Hardware
from overlap_ckpt.testing import emulate_accelerator

from conftest import assert_bitwise, assert_within_ulps, check_windows, make_params, run_loop

@pytest.mark.parametrize("tx", [optax.adam(1e-2), optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))],
                         ids=["adam", "clip+adamw"])
def test_barrier_isolation_replays_within_the_ulp_bound(tx):
    with emulate_accelerator("gpu"):
        engine, sink, refs = run_loop(tx, make_params([(37, 5), (5,), (300, 16)]), window=3, interval=6, steps=19)
    assert engine.plan.platform == "gpu"  # the optimization_barrier branch of capture.isolated_gradients
    assert sorted(sink.saved) == sorted(refs) == [6, 12, 18]
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert_within_ulps((tree["params"], tree["opt_state"]), ref, f"version {version}")


def _train_state(tx):
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((64, 32), np.float32)), "b": jnp.zeros(32)}
    return oc.TrainState.create(apply_fn=None, params=params, tx=tx)


@functools.partial(jax.jit, donate_argnums=0)
def _step(state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def test_window_auto_picks_the_k_the_cost_model_gives(tmp_path):
    tx = optax.adam(1e-3)
    step_time, bandwidth, interval = 0.01, 2e6, 20  # a slow link: one step cannot hide the copy
    x = jnp.linspace(-1, 1, 4 * 64).reshape(4, 64)
    with emulate_accelerator("gpu", step_time_s=step_time, d2h_bytes_per_s=bandwidth):
        with oc.CheckpointManager(tmp_path, save_interval_steps=interval, window="auto") as mngr:
            state = mngr.prepare(_train_state(tx))
            assert mngr.engine.schedule.k == 1  # until measured
            plan = mngr.engine.plan
            want = costmodel.choose_k(costmodel.TrainingProfile(
                step_time_s=step_time, d2h_bytes_per_s=bandwidth, state_bytes=plan.state_bytes,
                grad_bytes=plan.grad_bytes, persist_bytes_per_s=mngr.persist_bytes_per_s), interval_steps=interval)
            assert want > 1, "the numbers must make auto-K leave K=1, or this test proves nothing"
            references = {}
            for t in range(2 * interval + 1):
                state = mngr.step(_step(state, x * (t + 1) / 10))
                if (t + 1) % interval == 0:
                    references[t + 1] = jax.device_get((state.params, state.opt_state))
            assert mngr.engine.schedule.k == want and mngr.engine.plan.k == want
            mngr.wait_until_finished()
            assert mngr.all_steps() == [interval, 2 * interval]
            for version, ref in references.items():
                saved = mngr.restore(version)
                assert_within_ulps((saved["params"], saved["opt_state"]), ref, f"version {version}")
    assert MEASURE_STEPS < interval


def test_window_auto_predicts_k_from_the_steps_program_before_the_first_window(tmp_path):
    """On a device whose numbers are known, compile_ahead chooses K from the step's flops:
    the first window already has K phases. Reference: the cost model run directly on the
    flops of the step compiled without overlap_ckpt. The measurement that follows says
    the same step time here, so K stays."""
    tx = optax.adam(1e-3)
    interval, mfu = 20, MFU
    x = jnp.linspace(-1, 1, 4 * 64).reshape(4, 64)
    # Slow enough that one step cannot hide the copy of the state: K must leave 1.
    hardware = Hardware(peak_flops=2e7, hbm_bytes_per_s=1e12, host_link_bytes_per_s=2e6,
                        device_memory_bytes=1e12, sources="a made-up device")
    flops = jax.jit(_step.__wrapped__).lower(_train_state(tx), x).compile().cost_analysis()["flops"]
    step_time = flops / (hardware.peak_flops * mfu)
    with emulate_accelerator("gpu", hardware=hardware, step_time_s=step_time,
                             d2h_bytes_per_s=hardware.host_link_bytes_per_s):
        with oc.CheckpointManager(tmp_path, save_interval_steps=interval, window="auto") as mngr:
            state = mngr.prepare(_train_state(tx))
            plan = mngr.engine.plan
            want = costmodel.choose_k(costmodel.TrainingProfile(
                step_time_s=step_time, d2h_bytes_per_s=hardware.host_link_bytes_per_s,
                state_bytes=plan.state_bytes, grad_bytes=plan.grad_bytes,
                persist_bytes_per_s=mngr.persist_bytes_per_s), interval_steps=interval)
            assert want > 1, "the numbers must make auto-K leave K=1, or this test proves nothing"
            mngr.compile_ahead(_step, state, x)  # the prediction is made here, before any step
            assert mngr.engine.schedule.k == want
            assert mngr.window_prediction.k == want
            # From the lowered program's flops: the optimized one's differ by a few (fusion).
            assert mngr.window_prediction.step_time_s == pytest.approx(step_time, rel=1e-2)
            phases, references = [], {}
            for t in range(2 * interval + 1):
                if mngr.next_window_phase is not None:
                    phases.append(mngr.next_window_phase)
                state = mngr.step(_step(state, x * (t + 1) / 10))
                if (t + 1) % interval == 0:
                    references[t + 1] = jax.device_get((state.params, state.opt_state))
            assert phases == [*range(want), *range(want)], "the windows did not run with the predicted K"
            mngr.wait_until_finished()
            assert mngr.all_steps() == [interval, 2 * interval]
            for version, ref in references.items():
                saved = mngr.restore(version)
                assert_within_ulps((saved["params"], saved["opt_state"]), ref, f"version {version}")


def test_window_auto_measurement_corrects_a_wrong_prediction(tmp_path):
    """The datasheet says the step is short (K=7), the device measures a long one (K=1):
    the windows after the measurement (here all: it ends before the first) use K=1."""
    hardware = Hardware(peak_flops=2e7, hbm_bytes_per_s=1e12, host_link_bytes_per_s=2e6,
                        device_memory_bytes=1e12, sources="a made-up device")
    x = jnp.linspace(-1, 1, 4 * 64).reshape(4, 64)
    with emulate_accelerator("gpu", hardware=hardware, step_time_s=10.0, d2h_bytes_per_s=2e6):
        with oc.CheckpointManager(tmp_path, save_interval_steps=20, window="auto") as mngr:
            state = mngr.prepare(_train_state(optax.adam(1e-3)))
            mngr.compile_ahead(_step, state, x)
            predicted = mngr.window_prediction.k
            assert predicted > 1 and mngr.engine.schedule.k == predicted
            phases = []
            for t in range(61):
                if mngr.next_window_phase is not None:
                    phases.append(mngr.next_window_phase)
                state = mngr.step(_step(state, x))
            assert mngr.engine.schedule.k == 1
            assert phases == [0, 0, 0]


def test_window_auto_measures_on_a_device_it_has_no_numbers_for(tmp_path):
    with emulate_accelerator("gpu", step_time_s=0.01, d2h_bytes_per_s=2e6, hardware=None):
        with oc.CheckpointManager(tmp_path, save_interval_steps=20, window="auto") as mngr:
            x = jnp.ones((4, 64))
            state = mngr.prepare(_train_state(optax.adam(1e-3)))
            mngr.compile_ahead(_step, state, x)
            assert mngr.window_prediction is None and mngr.engine.schedule.k == 1  # until measured


def _cost_model_k(mngr, step_time: float, bandwidth: float, interval: int, **profile) -> int:
    """The reference: the cost model's rule run directly on the manager's plan (``profile``:
    the fraction and cap the emulation gives the compiled schedule)."""
    plan = mngr.engine.plan
    return costmodel.choose_k(costmodel.TrainingProfile(
        step_time_s=step_time, d2h_bytes_per_s=bandwidth, state_bytes=plan.state_bytes,
        grad_bytes=plan.grad_bytes, persist_bytes_per_s=mngr.persist_bytes_per_s, **profile),
        interval_steps=interval)


def _run_auto_window(mngr, state, x, interval: int) -> int:
    """Two intervals of steps after compile_ahead: the K auto settles on."""
    mngr.compile_ahead(_step, state, x)
    for t in range(2 * interval + 1):
        state = mngr.step(_step(state, x * (t + 1) / 10))
    return mngr.engine.schedule.k


def test_window_auto_chooses_k_with_the_share_of_the_step_its_compiled_copies_hide_under(tmp_path):
    """With compile_ahead, the measured K is chosen with the fraction of the step read from the
    compiled window phases (here given by the emulation: XLA:CPU's programs copy within one
    memory; compile-only on an H100, test_window_programs.py reads a real one), not with the
    cost model's constant. Reference: the cost model run directly with that fraction."""
    tx = optax.adam(1e-3)
    step_time, bandwidth, interval, fraction = 0.01, 2e6, 20, 0.15
    x = jnp.linspace(-1, 1, 4 * 64).reshape(4, 64)
    with emulate_accelerator("gpu", step_time_s=step_time, d2h_bytes_per_s=bandwidth, hide_fraction=fraction):
        with oc.CheckpointManager(tmp_path, save_interval_steps=interval, window="auto") as mngr:
            state = mngr.prepare(_train_state(tx))

            def k_with(f):
                return _cost_model_k(mngr, step_time, bandwidth, interval, overlappable_fraction=f)

            want, assumed = k_with(fraction), k_with(costmodel.TrainingProfile.overlappable_fraction)
            assert want != assumed, "the fraction must change K, or this test proves nothing"
            assert _run_auto_window(mngr, state, x, interval) == want


def test_window_auto_moves_k_past_a_compiled_schedule_that_serialized_copies(tmp_path):
    """Where the compiled phases overlapped only part of their copies and serialized the rest
    (XLA:TPU keeps a few host copies in flight; given here by the emulation), the measured K
    is one whose steps carry no more than that, although the step's time would hide the whole
    state. Reference: the cost model run directly with and without the cap."""
    tx = optax.adam(1e-3)
    step_time, bandwidth, interval = 10.0, 2e6, 20
    x = jnp.linspace(-1, 1, 4 * 64).reshape(4, 64)
    capacity = 2 * sum(leaf.nbytes for leaf in jax.tree.leaves(_train_state(tx).params))  # of params, mu, nu
    with emulate_accelerator("gpu", step_time_s=step_time, d2h_bytes_per_s=bandwidth, hide_fraction=1.0,
                             overlapped_bytes=capacity):
        with oc.CheckpointManager(tmp_path, save_interval_steps=interval, window="auto") as mngr:
            state = mngr.prepare(_train_state(tx))

            def k_with(cap):
                return _cost_model_k(mngr, step_time, bandwidth, interval, overlappable_fraction=1.0,
                                     schedule_capacity_bytes=cap)

            want = k_with(capacity)
            assert k_with(None) == 1 and want > 1, "the cap must change K, or this test proves nothing"
            assert _run_auto_window(mngr, state, x, interval) == want


def test_window_copies_in_another_memory_kind_stay_exact():
    with emulate_accelerator("cpu", outbox_memory="unpinned_host"):
        engine, sink, refs = run_loop(optax.adam(1e-2), make_params([(40, 6), (6,)]), window=2,
                                      interval=4, steps=13)
    assert engine.plan.outbox_memory == "unpinned_host"
    check_windows(sink, refs)


def test_emulation_is_undone():
    with emulate_accelerator("gpu", outbox_memory="unpinned_host"):
        pass
    tx = optax.sgd(0.1)
    engine, sink, refs = run_loop(tx, make_params([(8, 2)]), window=1, interval=2, steps=5)
    assert engine.plan.platform == "cpu" and engine.plan.outbox_memory == "pinned_host"
    tree, _ = sink.saved[2]
    assert_bitwise((tree["params"], tree["opt_state"]), refs[2])


@pytest.fixture
def no_cpu_backend(monkeypatch):
    """JAX as ``JAX_PLATFORMS=cuda`` leaves it: no CPU backend to replay windows on (the
    step still runs on this machine's CPU device, standing in for the accelerator). Seen on
    an H200 loan: K=1 was refused too, as an optimizer the host cannot replay."""
    local_devices = jax.local_devices

    def without_cpu(*args, backend=None, **kwargs):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return local_devices(*args, backend=backend, **kwargs)

    monkeypatch.setattr(jax, "local_devices", without_cpu)


def test_without_a_cpu_backend_a_window_of_k_steps_is_refused_at_prepare_naming_the_fix(tmp_path, no_cpu_backend):
    with oc.CheckpointManager(tmp_path, save_interval_steps=4, window=3) as mngr:
        with pytest.raises(oc.errors.ConfigError, match=r"JAX_PLATFORMS=cuda,cpu.*window=1"):
            mngr.prepare(_train_state(optax.adam(1e-3)))


def _train_and_check(mngr, steps, interval):
    """Steps the manager's loop and checks every checkpoint against the state it was taken of."""
    x = jnp.linspace(-1, 1, 4 * 64).reshape(4, 64)
    state = mngr.prepare(_train_state(optax.adam(1e-3)))
    references = {}
    for t in range(steps):
        state = mngr.step(_step(state, x * (t + 1) / 10))
        if (t + 1) % interval == 0:
            references[t + 1] = jax.device_get((state.params, state.opt_state))
    mngr.wait_until_finished()
    assert mngr.all_steps() == sorted(references)
    for version, ref in references.items():
        saved = mngr.restore(version)
        assert_bitwise((saved["params"], saved["opt_state"]), ref, f"version {version}")


def test_without_a_cpu_backend_window_1_checkpoints(tmp_path, no_cpu_backend):
    with oc.CheckpointManager(tmp_path, save_interval_steps=4, window=1) as mngr:
        _train_and_check(mngr, steps=9, interval=4)


def test_without_a_cpu_backend_window_auto_keeps_k_1_and_says_why(tmp_path, no_cpu_backend, caplog):
    interval = 20
    # A slow link: with a CPU backend, auto would leave K=1 (test_window_auto_picks_the_k_...).
    with emulate_accelerator("gpu", step_time_s=0.01, d2h_bytes_per_s=2e6):
        with oc.CheckpointManager(tmp_path, save_interval_steps=interval, window="auto") as mngr:
            _train_and_check(mngr, steps=2 * interval + 1, interval=interval)
            assert mngr.engine.schedule.k == 1
    assert "window='auto' keeps K=1" in caplog.text and "JAX_PLATFORMS" in caplog.text


def test_jit_compiler_options_hint_every_capturing_phase_copied_leaf_by_leaf(tmp_path, monkeypatch):
    """The plumbing of the GPU copy schedule hint (its effect on XLA:GPU's schedule:
    tests/aot/test_copy_schedule.py): the options name the hints directory and the parallel
    limit, the window plans copy leaf by leaf (also when the options are asked for after
    prepare), compile_ahead prepares a profile for every phase of the window, and the
    checkpoints are those of the state."""
    from overlap_ckpt.manager.copy_schedule import (PARALLEL_LIMIT, PARALLEL_LIMIT_OPTION, PGLE_OPTION,
                                                    CopyScheduleHints)

    prepared = []
    prepare = CopyScheduleHints.prepare
    monkeypatch.setattr(CopyScheduleHints, "prepare", lambda self, lowered: prepared.append(lowered) or prepare(self, lowered))
    interval, x = 3, jnp.linspace(-1, 1, 4 * 64).reshape(4, 64)
    with oc.CheckpointManager(tmp_path / "cpu", save_interval_steps=interval, window=2) as mngr:
        assert mngr.jit_compiler_options() == {}  # not a GPU: nothing to hint
    with emulate_accelerator("gpu"):
        with oc.CheckpointManager(tmp_path / "late", save_interval_steps=interval, window=2) as mngr:
            mngr.prepare(_train_state(optax.adam(1e-3)))
            assert mngr.engine.plan.pack_outbox  # a GPU plan packs by default
            mngr.jit_compiler_options(str(tmp_path / "late-hints"))
            assert not mngr.engine.plan.pack_outbox
        with oc.CheckpointManager(tmp_path / "ckpt", save_interval_steps=interval, window=2) as mngr:
            options = mngr.jit_compiler_options(str(tmp_path / "hints"))
            assert options == {PGLE_OPTION: str(tmp_path / "hints"), PARALLEL_LIMIT_OPTION: str(PARALLEL_LIMIT)}
            step = jax.jit(_step.__wrapped__, donate_argnums=0, compiler_options=options)
            state = mngr.prepare(_train_state(optax.adam(1e-3)))
            assert not mngr.engine.plan.pack_outbox
            mngr.compile_ahead(step, state, x)
            references = {}
            for t in range(2 * interval + 1):
                state = mngr.step(step(state, x * (t + 1) / 10))
                if (t + 1) % interval == 0:
                    references[t + 1] = jax.device_get((state.params, state.opt_state))
            mngr.wait_until_finished()
            assert len(prepared) == 2, "both phases of the window are hinted"
            for version, ref in references.items():
                saved = mngr.restore(version)
                assert_within_ulps((saved["params"], saved["opt_state"]), ref, f"version {version}")
