"""``window="auto"``: choose K from the step's cost and the device-to-host bandwidth.

On the CPU backend the "device" is host memory and nothing overlaps, so K is 1. On an
accelerator K comes from the cost model's one rule
(:func:`overlap_ckpt.costmodel.window.choose_window`) with one of two step times:

* **predicted**, when the step is given to ``compile_ahead`` and the device is one whose
  numbers :mod:`overlap_ckpt.costmodel.hardware` knows (H100, H200, TPU v4/v5e/v5p/v6e): the
  step's own program, lowered once, gives its flops (XLA's cost analysis), and the step time
  is the one ``overlap-ckpt aot`` predicts for that target
  (:func:`overlap_ckpt.costmodel.window.predict_window`). K is known
  before the first window, which already runs with it;
* **measured** (:class:`AutoWindow`), in every run on an accelerator: the manager times a
  few steps outside windows (two host syncs in the whole run), measures the
  device-to-host bandwidth once, and the next window uses the K it gives (K=1 until then
  when nothing was predicted). A prediction rests on a datasheet and an assumed MFU; the
  measurement corrects it.

The machine-dependent inputs (the clock, the bandwidth probe, the device's numbers) are
module attributes that tests replace (:func:`overlap_ckpt.testing.emulate_accelerator`) to
run both paths on the CPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import jax

from ..core import backend
from ..core.window_context import window_ticket
from ..costmodel.hardware import hardware_of as _known_hardware
from ..costmodel.hardware import measure_d2h_bandwidth
from ..costmodel.window import PredictedWindow, choose_window, predict_window
from ..errors import ConfigError

log = logging.getLogger(__name__)

MEASURE_STEPS = 5  # steps timed before choosing K

# Replaced by overlap_ckpt.testing to exercise the accelerator paths on the CPU backend.
measure_bandwidth: Callable[[Any], float] = measure_d2h_bandwidth
clock: Callable[[], float] = time.perf_counter
hardware_of: Callable[[Any], Any] = _known_hardware  # -> costmodel.hardware.Hardware | None


class AutoWindow:
    """Times ``MEASURE_STEPS`` steps after :meth:`start`, then proposes K once."""

    def __init__(self, interval_steps: int, persist_bytes_per_s: float):
        self.interval_steps = interval_steps
        self.persist_bytes_per_s = persist_bytes_per_s
        self._start: tuple[float, int] | None = None
        self.done = False
        self.step_time_s: float | None = None

    def wants_measurement(self, leaf: Any) -> bool:
        """False where K=1 is final: on the CPU backend, and where JAX's CPU backend, which
        replays windows of K > 1, is not initialized (``JAX_PLATFORMS=cuda``)."""
        device = next(iter(leaf.sharding.device_set))
        if backend.platform_of(device) == "cpu":
            self.done = True
        elif not self.done:
            try:
                backend.replay_device()
            except ConfigError as e:
                log.warning("window='auto' keeps K=1: %s", e)
                self.done = True
        return not self.done

    def restart(self) -> None:
        """Forget a partial measurement (a resume, a re-plan)."""
        self._start = None

    def observe(self, leaf: jax.Array, step: int, state_bytes: int, grad_bytes: int) -> int | None:
        """Call after a step outside a window with one leaf of the new state; returns K when
        the measurement is complete, else None (and None forever after)."""
        if self.done:
            return None
        if self._start is None:
            leaf.block_until_ready()
            self._start = (clock(), step)
            return None
        start, start_step = self._start
        if step - start_step < MEASURE_STEPS:
            return None
        leaf.block_until_ready()
        self.step_time_s = (clock() - start) / (step - start_step)
        self.done = True
        try:
            k = choose_window(self.step_time_s, measure_bandwidth(next(iter(leaf.sharding.device_set))),
                              state_bytes, grad_bytes, self.persist_bytes_per_s, self.interval_steps)
        except Exception as e:  # noqa: BLE001 - auto-tuning must never break training
            log.warning("window='auto' could not choose K (%s); keeping K=1", e)
            return 1
        log.info("window='auto': step %.4fs, K=%d", self.step_time_s, k)
        return k


def bytes_per_device(plan: Any) -> tuple[float, float]:
    """State and gradient bytes one device copies in a window of ``plan``: this process's
    blocks over its devices (each copies its own shards over its own link)."""
    devices = len(plan.params[0].sharding.addressable_devices)
    return plan.state_bytes / devices, plan.grad_bytes / devices


class WindowChoice:
    """The window size of one manager: ``window`` as given, or ``"auto"``'s K, first
    predicted from the step's program where the device is known, then measured."""

    def __init__(self, window: int | str, interval_steps: int | None, persist_bytes_per_s: float):
        self.window = window
        self.interval_steps = interval_steps
        self.persist_bytes_per_s = persist_bytes_per_s
        self.auto: AutoWindow | None = None  # measuring; None once measured (or never)
        self.prediction: PredictedWindow | None = None

    def first_k(self, leaf: Any) -> int:
        """K of a new engine, whose state has ``leaf`` (None: no leaves); ``"auto"`` starts
        a measurement where it can change K (not on the CPU backend)."""
        self.auto = None
        if self.window != "auto":
            return self.window
        auto = AutoWindow(self.interval_steps, self.persist_bytes_per_s)
        if leaf is not None and auto.wants_measurement(leaf):
            self.auto = auto
        return 1

    def restart(self) -> None:
        """Forget a partial measurement (a resume, a re-plan)."""
        if self.auto is not None:
            self.auto.restart()

    def predict(self, step_fn: Any, args: tuple, kwargs: dict, plan: Any) -> int | None:
        """While measuring: K for the plain step ``step_fn(*args, **kwargs)`` from its flops
        on the known device ``plan``'s state lives on (lowered, not compiled). None: not
        measuring, an unknown device or no cost analysis (the measurement decides)."""
        if self.auto is None:
            return None
        with window_ticket(None):  # the user's own program, whatever the next step captures
            lowered = step_fn.lower(*args, **kwargs)
        sharding = plan.params[0].sharding
        predicted = predict_window(lowered, hardware_of(next(iter(sharding.addressable_devices))),
                                   len(sharding.device_set), *bytes_per_device(plan),
                                   self.persist_bytes_per_s, self.interval_steps)
        if predicted is None:
            return None
        self.prediction = predicted
        return predicted.k

    def observe(self, params: Any, step: int, plan: Any) -> int | None:
        """After a plain step that left ``params``: the measured K once the measurement is
        complete, else None."""
        if self.auto is None:
            return None
        k = self.auto.observe(jax.tree.leaves(params)[0], step, *bytes_per_device(plan))
        if k is not None:
            self.auto = None
        return k
