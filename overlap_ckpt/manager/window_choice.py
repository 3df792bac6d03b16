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

Both rules need the fraction of a step a window's copies hide under. The measured K uses
the one read from where the compiled schedule of the phases ``compile_ahead`` compiled
starts and ends each copy (:meth:`WindowChoice.read_schedule`; XLA:GPU starts a state copy
late in the step, so it is far below the cost model's constant: 0.14-0.34 of a 1B LM's step
on an H200 against 0.9), and, where that schedule serialized copies (XLA:TPU keeps only a
few in flight), the bytes it overlapped as a cap on what a step hides; where the phases are
still compiling when the measurement ends, K is chosen with the constant and once more when
they are read. Without ``compile_ahead``, and for the prediction, the constant.

The machine-dependent inputs (the clock, the bandwidth probe, the device's numbers) are
module attributes that tests replace (:func:`overlap_ckpt.testing.emulate_accelerator`) to
run both paths on the CPU.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable

import jax

from ..core import backend
from ..core.window_context import window_ticket
from ..costmodel.hardware import hardware_of as _known_hardware
from ..costmodel.hardware import measure_d2h_bandwidth
from ..costmodel.window import CompiledSchedule, PredictedWindow, choose_window, predict_window
from ..errors import ConfigError

log = logging.getLogger(__name__)

MEASURE_STEPS = 5  # steps timed before choosing K


def _compiled_schedule(compiled: Any) -> CompiledSchedule:
    from ..aot.predict import compiled_schedule  # the HLO reader, imported only where it is used
    return compiled_schedule(compiled)


# Replaced by overlap_ckpt.testing to exercise the accelerator paths on the CPU backend.
measure_bandwidth: Callable[[Any], float] = measure_d2h_bandwidth
clock: Callable[[], float] = time.perf_counter
hardware_of: Callable[[Any], Any] = _known_hardware  # -> costmodel.hardware.Hardware | None
schedule_of: Callable[[Any], CompiledSchedule] = _compiled_schedule  # of a compiled window phase


class AutoWindow:
    """Times ``MEASURE_STEPS`` steps after :meth:`start`, then proposes K once."""

    def __init__(self, interval_steps: int, persist_bytes_per_s: float):
        self.interval_steps = interval_steps
        self.persist_bytes_per_s = persist_bytes_per_s
        self._start: tuple[float, int] | None = None
        self.done = False
        self.step_time_s: float | None = None
        self.d2h_bytes_per_s: float | None = None

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

    def observe(self, leaf: jax.Array, step: int, state_bytes: int, grad_bytes: int,
                schedule: CompiledSchedule | None = None) -> int | None:
        """Call after a step outside a window with one leaf of the new state; returns K when
        the measurement is complete, else None (and None forever after). ``schedule``: what
        the window's compiled phases say of their copies (None: the cost model's constant)."""
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
            self.d2h_bytes_per_s = measure_bandwidth(next(iter(leaf.sharding.device_set)))
        except Exception as e:  # noqa: BLE001 - auto-tuning must never break training
            log.warning("window='auto' could not measure the device-to-host bandwidth (%s); keeping K=1", e)
            return 1
        return self.choose(state_bytes, grad_bytes, schedule)

    def choose(self, state_bytes: float, grad_bytes: float, schedule: CompiledSchedule | None = None) -> int:
        """K for the measured step time and bandwidth; ``schedule``: what the window's
        compiled phases say of their copies (None: the cost model's constant)."""
        schedule = schedule or CompiledSchedule()
        fraction = {} if schedule.hide_fraction is None else {"overlappable_fraction": schedule.hide_fraction}
        try:
            k = choose_window(self.step_time_s, self.d2h_bytes_per_s, state_bytes, grad_bytes,
                              self.persist_bytes_per_s, self.interval_steps, **fraction,
                              schedule_capacity_bytes=schedule.overlapped_bytes)
        except Exception as e:  # noqa: BLE001 - auto-tuning must never break training
            log.warning("window='auto' could not choose K (%s); keeping K=1", e)
            return 1
        log.info("window='auto': step %.4fs, copies hide under %s of it%s, K=%d", self.step_time_s,
                 "an assumed share" if schedule.hide_fraction is None
                 else f"{schedule.hide_fraction:.2f} (compiled schedule)",
                 "" if schedule.overlapped_bytes is None
                 else f", at most {schedule.overlapped_bytes / 2**20:.1f} MiB (the rest serialized)", k)
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
        # Measured before the compiled schedule was read: chosen again once it is.
        self._unread: AutoWindow | None = None
        self.prediction: PredictedWindow | None = None
        # Per plan compile_ahead compiled variants of, per phase: what its compiled schedule
        # says of the phase's copies. Written on the compile-ahead threads; a re-planned K
        # runs a second job beside the first, so two plans' readings arrive interleaved.
        self._readings: list[tuple[Any, dict[int, CompiledSchedule]]] = []
        self._complete: CompiledSchedule | None = None  # of the latest plan read to the end
        self._reading_lock = threading.Lock()

    def first_k(self, leaf: Any) -> int:
        """K of a new engine, whose state has ``leaf`` (None: no leaves); ``"auto"`` starts
        a measurement where it can change K (not on the CPU backend)."""
        self.auto = self._unread = None
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

    def read_schedule(self, plan: Any, phase: int, compiled: Any) -> None:
        """On the compile-ahead thread, for each variant it compiled (``compiled``, copying
        ``phase`` of ``plan``): while K is adapting on an accelerator, what its compiled
        schedule says of the phase's copies (:func:`overlap_ckpt.aot.predict.compiled_schedule`;
        the tighter of the variants of a phase, where a step shared by several managers has
        several)."""
        if not self.adapting:
            return
        try:
            reading = schedule_of(compiled)
        except Exception as e:  # noqa: BLE001 - auto-tuning must never break training
            log.info("window='auto': the compiled schedule could not be read (%s); assuming a share", e)
            return
        if reading.hide_fraction is None:
            return
        with self._reading_lock:
            readings = next((r for read, r in self._readings if read is plan), None)
            if readings is None:
                readings = {}
                self._readings.append((plan, readings))
            readings[phase] = reading.least(readings.get(phase, reading))
            if len(readings) >= plan.k:
                self._complete = functools.reduce(CompiledSchedule.least, readings.values())

    @property
    def schedule(self) -> CompiledSchedule | None:
        """What the compiled schedules of every phase of a window compiled ahead say of their
        copies (the tightest of its phases'), for the latest plan whose phases were all read;
        None until one was. Each plan's readings are kept apart: an old plan's job reading
        between a new plan's phases once left neither plan complete, and K at the cost
        model's constant for the rest of the run."""
        return self._complete

    @property
    def adapting(self) -> bool:
        """Whether a later plain step may still change K (:meth:`observe`)."""
        return self.auto is not None or self._unread is not None

    def observe(self, params: Any, step: int, plan: Any) -> int | None:
        """After a plain step that left ``params``: the measured K once the measurement is
        complete, chosen with the fraction of the step the compiled window's copies hide
        under where ``compile_ahead`` has read it by then; where it had not, K is chosen
        again, once, when it has (the compile runs beside the first steps). Else None."""
        schedule = self.schedule
        if self.auto is not None:
            k = self.auto.observe(jax.tree.leaves(params)[0], step, *bytes_per_device(plan), schedule)
            if k is not None:
                measured = self.auto.d2h_bytes_per_s is not None
                self.auto, self._unread = None, (self.auto if schedule is None and measured else None)
            return k
        if self._unread is None or schedule is None:
            return None
        unread, self._unread = self._unread, None
        return unread.choose(*bytes_per_device(plan), schedule)
