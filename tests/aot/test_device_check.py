"""``overlap-ckpt aot --target gpu --measure`` runs the compiled programs on the machine's
GPU. CI has none, so its parts are checked here on the CPU, where they run the same way:
the filled state, the timing of chained calls, the whole calibration on the tiny LM."""

import dataclasses
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from overlap_ckpt.aot import get_target, predict
from overlap_ckpt.costmodel import gpu_specs
from overlap_ckpt.costmodel.hardware import hardware_of
from overlap_ckpt.tools.aot import device_check
from overlap_ckpt.tools.aot.benchmark import _start
from overlap_ckpt.tools.aot.lm_step import lm_setup, lower_with, plan_window
from overlap_ckpt.aot.window import compiled_phases

from conftest import compile_threads

SLEEP_S = 0.05


def test_the_state_is_filled_with_real_values_without_compiling():
    setup = lm_setup(get_target("cpu"), "tiny")
    compiles = compile_threads("")  # every compile from here on
    filled = device_check.filled_like(setup.opt_state, seed=1)
    abstract, leaves = jax.tree.leaves(setup.opt_state), jax.tree.leaves(filled)
    assert len(leaves) == len(abstract) > 30
    assert not compiles, compiles  # a program that draws them compiles a kernel per leaf (minutes for 1B on a GPU)
    assert len({np.asarray(x).tobytes()[:64] for x in leaves if x.size > 16}) > 1, "every leaf the same values"
    for x, a in zip(leaves, abstract):
        assert (x.shape, x.dtype, x.sharding) == (a.shape, a.dtype, a.sharding)
        values = np.asarray(x)
        if jnp.issubdtype(a.dtype, jnp.floating):
            assert values.min() >= 0 and values.max() < 0.02
            assert values.size == 1 or values.std() > 0, "not real data: every element equal"
        else:
            assert not values.any()


class Pending:
    """An output still being computed (or copied to the host): ready SLEEP_S after it is waited for."""

    made: list = []

    def __init__(self):
        self.waited = False
        Pending.made.append(self)

    def block_until_ready(self):
        time.sleep(SLEEP_S)
        self.waited = True
        return self


def _step(params, opt_state, batch, count):
    """A step of the measured programs' signature whose loss and outbox are not ready yet."""
    return params + 1, opt_state, count + 1, Pending(), Pending()


def test_each_timed_call_is_waited_for_and_the_state_chains_from_call_to_call():
    Pending.made.clear()
    state = device_check.ChainedState(np.zeros(4), np.zeros(2), np.ones(3), 0)
    seconds = device_check.time_calls(_step, state, timed=3, warmup=2)
    assert len(Pending.made) == 10 and all(p.waited for p in Pending.made)  # the loss and the host copies
    assert seconds >= 2 * SLEEP_S  # a lower bound only: a call cannot end before its outputs are ready
    assert state.count == 5
    np.testing.assert_array_equal(state.params, np.full(4, 5.0))


def test_the_calibration_runs_the_plain_step_and_every_phase_on_the_targets_devices(tmp_path):
    run = _start(get_target("cpu"), "tiny", [2], (10,), 4, log=lambda line: None)
    plan = plan_window(run.setup, 2)
    compiled = list(compiled_phases(lower_with(run.setup), plan))
    window = dataclasses.replace(run.probe, plan=plan, phases=tuple(r for r, _ in compiled))
    logged = []
    result = device_check.calibrate(run.setup, run.cost, run.plain_program, {2: window},
                                    {2: tuple(p for _, p in compiled)}, orbax=False, log=logged.append,
                                    profile_dir=str(tmp_path), link_probe_bytes=64 << 20)
    assert [p.name for p in result.windows[2]] == ["phase 0 of 2", "phase 1 of 2"]
    assert all(s > 0 for s in result.plain_s) and all(p.measured_s > 0 for p in result.windows[2])
    predicted, measured = result.window_stall_s(2)
    assert predicted == predict.window_stall_s(window, run.cost)
    assert measured == sum(p.measured_s for p in result.windows[2]) - 2 * result.measured_step_s
    assert result.measured_orbax_save_block_s is None
    text = result.markdown((10,))
    assert "| phase 1 of 2 |" in text and "overlap K=2 window stall" in text
    assert any("plain step again" in line for line in logged)
    # the trace before the host link, device_get and Orbax: a loan's limit stops those first
    order = [next(i for i, line in enumerate(logged) if what in line) for what in ("traced", "host link")]
    assert order == sorted(order), logged
    traces = list(tmp_path.rglob("*.xplane.pb"))
    assert len(traces) == 1
    events = {event.name for plane in jax.profiler.ProfileData.from_file(str(traces[0])).planes
              for line in plane.lines for event in line.events}
    assert any("jit(step)" in name for name in events), sorted(events)[:40]  # the programs ran inside it


def test_an_h200_has_its_own_memory_figures_and_the_h100s_rates():
    hardware = hardware_of(types.SimpleNamespace(device_kind="NVIDIA H200"))
    h100 = hardware_of(types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3"))
    assert hardware is not None and h100 is not None
    assert hardware.hbm_bytes_per_s == 4.8e12 and hardware.device_memory_bytes == 141e9
    assert (hardware.peak_flops, hardware.host_link_bytes_per_s) == (h100.peak_flops, h100.host_link_bytes_per_s)
    assert hardware_of(types.SimpleNamespace(device_kind="NVIDIA H200"), host_gbps=50).host_link_bytes_per_s == 50e9


def test_a_gpus_step_time_comes_from_the_callers_flops_not_xla_gpus_cost_analysis():
    """XLA:GPU counted 2.75e13 flops for the 1B LM's step that 6N per token puts at 1.03e14."""
    target = types.SimpleNamespace(platform="gpu", name="gpu (NVIDIA H200)", peak_flops=gpu_specs.H100_BF16_FLOPS,
                                   hbm_bytes_per_s=gpu_specs.H200_HBM_BYTES_PER_S)
    report = types.SimpleNamespace(target=target, plain=types.SimpleNamespace(flops=2.75e13, bytes_accessed=2.53e11))
    cost = predict.step_cost(report, flops_hint=1.03e14)
    assert cost.flops == 1.03e14
    assert abs(cost.step_time_s - 1.03e14 / (gpu_specs.H100_BF16_FLOPS * predict.MFU)) < 1e-12


def test_orbax_stall_is_timed_on_stock_orbax_and_leaves_nothing_behind(tmp_path):
    tree = {"w": jnp.arange(1024.0).reshape(32, 32), "b": jnp.ones(32)}
    seconds = device_check.measure_orbax_save_block_s(tree, directory=str(tmp_path), saves=2)
    assert seconds > 0
    assert list(tmp_path.iterdir()) == []  # its checkpoints and directory removed
