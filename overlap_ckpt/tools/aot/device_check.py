"""The prediction set beside the accelerator's own run of the same compiled programs.

``overlap-ckpt aot --target gpu --measure``, on a machine with a GPU: the plain step and
every window phase that the report compiled for the real device run on filled arrays of
the state's shapes, each for a few steps, the state chained from one call to the next as
in training. A phase's stall is its measured time less the plain step's, the quantity
:func:`overlap_ckpt.aot.predict.window_stall_s` predicts from the schedule; the host link
is measured with the capture's own kind of copy; Orbax async's stall is measured twice,
as the copy of the state to host memory that it waits for (``jax.device_get``) and as the
time stock Orbax's own async ``save`` blocks the caller.

Why random-filled arrays and not zeros: matrix units run faster on zeros than on real data
(seen once on an H200 here: 13% for a bf16 matmul), which would flatter the step time.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...costmodel.hardware import measure_d2h_bandwidth
from ...aot import predict
from ...aot.window import WindowReport
from .lm_step import LMSetup

# Few calls: a 1B model's phases move gigabytes per call, and a loaned GPU's time is short.
# Two warm-up calls: an idle GPU's clocks take a call or more to rise (an H200 here sat at
# 345 MHz before the first program).
WARMUP_CALLS = 2
TIMED_CALLS = 3
HOST_LINK_PROBE_BYTES = 1 << 30
# Below 0.02 after rounding to bfloat16 too: the filled values' bound, as an initializer's scale.
FILL_MAX = 0.0195


def filled_like(tree: Any, seed: int = 0) -> Any:
    """Real arrays of an abstract tree's shapes, dtypes and shardings: floats uniform in
    [0, FILL_MAX), as the leaf's dtype rounds them (non-negative, so Adam's second moment
    stays valid), integers zero.

    Nothing compiles: one host buffer of random floats, twice the largest leaf, gives each
    leaf a window of it at a random offset, put onto the devices. Drawing the values on the
    device instead compiled one random-number kernel per leaf, even in one program: 49 s for
    the 1B LM's parameters and 125 s for its Adam moments on XLA:GPU (deviceless H100 target,
    2 cores), which took 110 s of a loaned H200's time before its first measurement."""
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [math.prod(x.shape) for x in leaves]
    longest = max(sizes, default=1)
    rng = np.random.default_rng(seed)
    pool = rng.random(2 * longest, dtype=np.float32) * np.float32(FILL_MAX)
    filled = []
    for x, size in zip(leaves, sizes):
        if jnp.issubdtype(x.dtype, jnp.floating):
            start = int(rng.integers(0, longest + 1))
            host = pool[start:start + size].reshape(x.shape).astype(x.dtype, copy=False)
        else:
            host = np.zeros(x.shape, x.dtype)
        filled.append(jax.device_put(host, x.sharding))
    return jax.tree.unflatten(treedef, filled)


@dataclasses.dataclass
class ChainedState:
    """The step's carried arguments: each call donates them and returns the next."""

    params: Any
    opt_state: Any
    batch: Any
    count: Any


def time_calls(program: Any, state: ChainedState, timed: int = TIMED_CALLS, warmup: int = WARMUP_CALLS) -> float:
    """Median wall time of ``program(params, opt_state, batch, count)`` (a compiled step of
    :mod:`overlap_ckpt.tools.aot.lm_step`), each call waited for in full (its host copies too),
    after ``warmup`` calls; ``state`` advances with every call."""
    seconds = []
    for i in range(warmup + timed):
        start = time.perf_counter()
        params, opt_state, count, loss, outbox = program(state.params, state.opt_state, state.batch, state.count)
        jax.block_until_ready((params, opt_state, count, loss, outbox))
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
        state.params, state.opt_state, state.count = params, opt_state, count
        del outbox
    return statistics.median(seconds)


def measure_orbax_save_block_s(tree: Any, directory: str | None = None, saves: int = 2) -> float:
    """Seconds stock Orbax's async ``save`` blocks the caller (its copy of the state off the
    device), the last of ``saves`` (the first also sets Orbax up); every save is finished
    before the next and the directory is removed."""
    import orbax.checkpoint as ocp

    root = tempfile.mkdtemp(prefix="overlap-ckpt-orbax-", dir=directory)
    try:
        with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(
                max_to_keep=1, enable_async_checkpointing=True)) as mngr:
            blocked = []
            for step in range(saves):
                start = time.perf_counter()
                mngr.save(step, args=ocp.args.StandardSave(tree))
                blocked.append(time.perf_counter() - start)
                mngr.wait_until_finished()
        return blocked[-1]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure_device_get_s(tree: Any, repeats: int = 3) -> float:
    """Median seconds of ``jax.device_get`` of a fresh device copy of ``tree``: the state's
    copy to host memory. Fresh, because an array keeps the host copy ``device_get`` made
    of it, and a second ``device_get`` of the same array copies nothing (on an H200: 10 ms
    for 11 GiB)."""
    copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    seconds = []
    for _ in range(repeats):
        fresh = jax.block_until_ready(copy(tree))
        start = time.perf_counter()
        host = jax.device_get(fresh)
        seconds.append(time.perf_counter() - start)
        del host, fresh
    return statistics.median(seconds)


@dataclasses.dataclass(frozen=True)
class PhaseMeasurement:
    name: str
    outbox_bytes: int
    predicted_stall_s: float
    measured_s: float  # the phase's step time


@dataclasses.dataclass(frozen=True)
class DeviceCalibration:
    device: str
    predicted_step_s: float
    plain_s: tuple[float, float]  # the plain step timed before and after the phases
    predicted_host_link: float  # bytes/s
    measured_host_link: float
    predicted_orbax_stall_s: float
    measured_device_get_s: float
    measured_orbax_save_block_s: float | None
    windows: dict[int, tuple[PhaseMeasurement, ...]]

    @property
    def measured_step_s(self) -> float:
        """The plain step: the mean of its two timings (their spread is the noise floor of
        a phase's stall)."""
        return statistics.mean(self.plain_s)

    def window_stall_s(self, k: int) -> tuple[float, float]:
        """(predicted, measured) stall of a K window: the sum over its phases."""
        phases = self.windows[k]
        return (sum(p.predicted_stall_s for p in phases),
                sum(p.measured_s - self.measured_step_s for p in phases))

    def markdown(self, intervals: Sequence[int] = (10, 50)) -> str:
        def row(what, predicted, measured, unit="s"):
            ratio = f"{measured / predicted:.2f}" if predicted else "-"
            return f"| {what} | {predicted:.4g} | {measured:.4g} | {ratio} |"

        lines = [f"## Prediction against measurement ({self.device})", "",
                 f"Each program ran {WARMUP_CALLS} + {TIMED_CALLS} calls on random-filled arrays, the state "
                 "chained from call to call, every call waited for (its host copies too); medians. "
                 "A phase's stall is its time less the plain step's, timed before the phases and after them "
                 f"({self.plain_s[0]:.4f} s and {self.plain_s[1]:.4f} s: their difference is the noise of a stall).",
                 "", "| quantity | predicted | measured | measured / predicted |", "|---|---|---|---|",
                 row("plain step s (mean of the two)", self.predicted_step_s, self.measured_step_s),
                 row("host link GB/s (the capture's kind of copy, 1 GiB)", self.predicted_host_link / 1e9,
                     self.measured_host_link / 1e9),
                 row("Orbax async stall s: the state's copy to host (jax.device_get)",
                     self.predicted_orbax_stall_s, self.measured_device_get_s)]
        if self.measured_orbax_save_block_s is not None:
            lines.append(row("Orbax async stall s: stock Orbax `save` blocking the caller",
                             self.predicted_orbax_stall_s, self.measured_orbax_save_block_s))
        for k in sorted(self.windows):
            predicted, measured = self.window_stall_s(k)
            lines.append(row(f"overlap K={k} window stall s (sum over its phases)", predicted, measured))
        lines += ["", "| phase | outbox MiB | step s | stall s predicted | stall s measured |", "|---|---|---|---|---|"]
        for k in sorted(self.windows):
            for p in self.windows[k]:
                lines.append(f"| {p.name} | {p.outbox_bytes / 2**20:.1f} | {p.measured_s:.4f} | "
                             f"{p.predicted_stall_s:.4f} | {p.measured_s - self.measured_step_s:+.4f} |")
        orbax = self.measured_orbax_save_block_s or self.measured_device_get_s
        lines += ["", "ETTR from the measured figures (step time and stalls above):", "",
                  "| strategy | " + " | ".join(f"N={n}" for n in intervals) + " |",
                  "|---|" + "---|" * len(intervals),
                  "| Orbax async | " + " | ".join(f"{predict.ettr(self.measured_step_s, orbax, n):.4f}"
                                                  for n in intervals) + " |"]
        for k in sorted(self.windows):
            stall = max(0.0, self.window_stall_s(k)[1])
            lines.append(f"| overlap K={k} | " + " | ".join(
                f"{predict.ettr(self.measured_step_s, stall, n):.4f}" if n >= k else "-" for n in intervals) + " |")
        return "\n".join(lines) + "\n"


def calibrate(setup: LMSetup, cost: predict.StepCost, plain: Any, windows: dict[int, WindowReport],
              phase_programs: dict[int, Sequence[Any]], orbax: bool = True,
              log: Callable[[str], None] = lambda line: None, profile_dir: str | None = None,
              link_probe_bytes: int = HOST_LINK_PROBE_BYTES) -> DeviceCalibration:
    """Run ``plain`` and every phase program of ``windows`` (``phase_programs[k][j]``, the
    compiled phase j of the K window) on the target's devices, and measure the host link
    and Orbax's stall on the same state. ``log`` gets each figure as it is measured, with
    the seconds since the calibration began (a loan's time limit may stop it part way).
    ``profile_dir``: also trace one more call of the plain step and of each K's largest
    phase there (:func:`jax.profiler.trace`), to see when a copy runs within the step; the
    trace comes before the host link and Orbax are measured (Orbax writes the whole state
    to disk, twice), so that a loan's time limit stops the figures least needed.
    ``link_probe_bytes``: the size of the host-link probe (a GiB by default, to reach a
    GPU link's speed; a test on the CPU backend needs only its plumbing)."""
    started = time.perf_counter()

    def note(line: str) -> None:
        log(f"[{time.perf_counter() - started:6.1f} s] {line}")

    report = next(iter(windows.values()))
    state = ChainedState(filled_like(setup.params, 0), filled_like(setup.opt_state, 1),
                         filled_like(setup.batch, 2), filled_like(setup.step, 3))
    plain_before = time_calls(plain, state)
    note(f"plain step: {plain_before:.4f} s")
    measured = {}
    for k, window in sorted(windows.items()):
        phases = []
        for j, (p, program) in enumerate(zip(window.phases, phase_programs[k])):
            phases.append(PhaseMeasurement(p.name, predict.copy_bytes(window, j), predict.phase_stall_s(window, cost, j),
                                           time_calls(program, state)))
            note(f"{p.name}: {phases[-1].measured_s:.4f} s")
        measured[k] = tuple(phases)
    plain_after = time_calls(plain, state)
    note(f"plain step again, after the phases: {plain_after:.4f} s")
    if profile_dir:
        try:
            with jax.profiler.trace(profile_dir):
                time_calls(plain, state, timed=1, warmup=0)
                for k, window in sorted(windows.items()):
                    largest = max(range(k), key=lambda j: predict.copy_bytes(window, j))
                    time_calls(phase_programs[k][largest], state, timed=1, warmup=0)
            note(f"traced the plain step and each K's largest phase into {profile_dir}")
        except Exception as e:  # noqa: BLE001 - a profiler that cannot start must not lose the figures
            note(f"no trace: {type(e).__name__}: {e}")
    device = report.target.devices[0]
    tree = (state.params, state.opt_state)
    link = measure_d2h_bandwidth(device, nbytes=link_probe_bytes)
    note(f"host link: {link / 1e9:.2f} GB/s")
    device_get_s = measure_device_get_s(tree)
    note(f"jax.device_get of the state: {device_get_s:.4f} s")
    save_s = None
    if orbax:
        save_s = measure_orbax_save_block_s({"params": state.params, "opt_state": state.opt_state})
        note(f"Orbax async save blocked for {save_s:.4f} s")
    return DeviceCalibration(str(device.device_kind), cost.step_time_s, (plain_before, plain_after),
                             report.target.host_link_bytes_per_s, link, predict.orbax_async_stall_s(report),
                             device_get_s, save_s, measured)
