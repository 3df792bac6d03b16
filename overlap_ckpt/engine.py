"""The overlapped checkpoint engine: plans windows, replays them on the host, hands off.

The engine is framework-neutral. A training loop (or one of the integrations: Flax
``TrainState``, NNX optimizer, :class:`overlap_ckpt.CheckpointManager`) asks it for the
phase of each step, runs :func:`overlap_ckpt.capture.capture_update` inside its jitted
step, and passes the outbox back with :meth:`OverlapEngine.submit`. A background thread
waits for the host copies, replays, and calls the sink with the consistent state of V.
The training thread never waits on it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Protocol

import optax

from .errors import UnsupportedOptimizerError, WindowAborted
from .storage.errors import CheckpointError
from .jaxpr_interp import InterpretError
from .plan import CapturePlan, make_plan
from .replay import HostBuffers, ReplayPrograms, WindowReplay
from .schedule import WindowSchedule

log = logging.getLogger(__name__)


class Sink(Protocol):
    """Receives the consistent host state of version ``step`` (trees of HostArray).

    A sink may keep references to the arrays until it has persisted them. If it has a
    ``pending_steps()`` method (as :class:`overlap_ckpt.storage.CheckpointStore` does),
    the engine reuses a host copy once its step is no longer pending; otherwise every
    window gets a fresh host copy.
    """

    def save(self, step: int, tree: Any, metadata: dict | None = None) -> None: ...


class BufferPool:
    """Host copies of the state, reused across windows once the sink is done with them.

    Reuse matters: copying into freshly allocated memory page-faults on every page, which
    on a small host runs several times slower than copying into memory already touched.
    """

    def __init__(self, sink: Sink, max_free: int = 2):
        self.sink = sink
        self.max_free = max_free
        self._lent: list[tuple[int, HostBuffers]] = []  # (step, buffers) handed to the sink

    def acquire(self, plan: CapturePlan) -> HostBuffers:
        pending = getattr(self.sink, "pending_steps", None)
        if pending is not None:
            busy = set(pending())
            for i, (step, buffers) in enumerate(self._lent):
                if step not in busy and buffers.plan is plan:
                    del self._lent[i]
                    return buffers
        return HostBuffers(plan)

    def lend(self, step: int, buffers: HostBuffers) -> None:
        """Record that ``buffers`` were handed to the sink for ``step``."""
        if getattr(self.sink, "pending_steps", None) is None:
            return  # the sink keeps them: never reuse
        self._lent.append((step, buffers))
        del self._lent[:-self.max_free]


class MemorySink:
    """Keeps checkpoints in a dict; for tests and for callers that persist themselves."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[Any, dict | None]] = {}

    def save(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        self.saved[step] = (tree, metadata)


Combine = Callable[[Any, Any, Any], Any]


def default_combine(params, opt_state, extras) -> dict:
    """The saved tree when the caller does not give its own structure."""
    return {"params": params, "opt_state": opt_state, "extras": extras}


class OverlapEngine:
    """Runs K-step windows every ``interval`` steps for one optax transformation."""

    def __init__(self, tx: optax.GradientTransformation, sink: Sink, *, interval: int, window: int = 1,
                 chunk_leaves: bool | None = None, combine: Combine = default_combine):
        self.tx = tx
        self.sink = sink
        self.schedule = WindowSchedule.clamped(interval, window)
        self.chunk_leaves = chunk_leaves
        self.combine = combine
        self.plan: CapturePlan | None = None
        self._programs: ReplayPrograms | None = None
        self._queue: queue.Queue = queue.Queue()
        self._pool = BufferPool(sink)
        self._errors: list[BaseException] = []
        self.windows_completed = 0
        self.windows_aborted = 0
        self.replay_seconds = 0.0  # host time spent receiving and replaying phases
        self.replayed_bytes = 0  # state bytes advanced by replay, over completed windows
        # Optional timeline hook (benchmarks): set to a list to get one
        # (step, phase, start, end) tuple of time.perf_counter() per received phase.
        self.spans: list | None = None
        self._worker = threading.Thread(target=self._run, name="overlap-ckpt-replay", daemon=True)
        self._worker.start()

    # -- training thread ----------------------------------------------------------------
    def phase(self, step: int) -> int | None:
        return self.schedule.phase(step)

    def set_window(self, window: int) -> None:
        """Use windows of ``window`` steps from the next window on (e.g. once auto-K has
        measured the step); the next :meth:`plan_for` re-plans for it."""
        self.schedule = WindowSchedule.clamped(self.schedule.interval, window)
        self.plan = None

    def plan_for(self, params, opt_state, extras=None) -> CapturePlan:
        """The plan for this state, re-planned when its structure, shapes or dtypes changed."""
        if self.plan is not None:
            why = self.plan.matches(params, opt_state, extras)
            if why is None:
                return self.plan
            log.warning("train state changed (%s); the open window is discarded and the next one re-planned", why)
            self._queue.put(("abort", None, None, None, None))
        plan = make_plan(self.tx, params, opt_state, extras, self.schedule.k, chunk_leaves=self.chunk_leaves)
        programs = ReplayPrograms(plan)
        try:
            programs.check()
        except InterpretError as e:
            if not plan.chunked:
                raise UnsupportedOptimizerError(str(e)) from e
            log.info("row-chunked replay is not exact for this optimizer (%s); using whole-leaf slices", e)
            plan = make_plan(self.tx, params, opt_state, extras, self.schedule.k, chunk_leaves=False)
            programs = ReplayPrograms(plan)
            try:
                programs.check()
            except InterpretError as e2:
                raise UnsupportedOptimizerError(str(e2)) from e2
        if plan.k != self.schedule.k:
            self.schedule = WindowSchedule(self.schedule.interval, plan.k)
        self.plan, self._programs = plan, programs
        return plan

    def submit(self, step: int, phase: int, outbox: dict, metadata: dict | None = None) -> None:
        """Hand a step's outbox to the host worker; returns at once."""
        self._queue.put(("phase", step, phase, outbox, (self.plan, self._programs, metadata)))

    def wait_until_finished(self) -> None:
        """Block until every submitted phase is processed; raise the first worker error."""
        done = threading.Event()
        self._queue.put(("flush", None, None, None, done))
        done.wait()
        if self._errors:
            error, self._errors[:] = self._errors[0], []
            raise error

    def close(self) -> None:
        if self._worker.is_alive():
            self._queue.put(("stop", None, None, None, None))
            self._worker.join()

    # -- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        window: WindowReplay | None = None
        while True:
            kind, step, phase, outbox, extra = self._queue.get()
            if kind == "stop":
                return
            if kind == "flush":
                extra.set()
                continue
            if kind == "abort":
                window = self._abort(window, "the train state changed")
                continue
            plan, programs, metadata = extra
            try:
                version = step - phase + plan.k - 1
                if phase == 0:
                    if window is not None:
                        self._abort(window, f"a new window for step {version} started")
                    window = WindowReplay(plan, self._pool.acquire(plan), version, programs)
                if window is None or window.plan is not plan or window.version != version:
                    continue  # joined mid-window (e.g. after a resume): wait for the next one
                start = time.perf_counter()
                window.receive(phase, outbox)
                end = time.perf_counter()
                self.replay_seconds += end - start
                if self.spans is not None:
                    self.spans.append((step, phase, start, end))
                if window.complete:
                    params, opt_state, extras = window.result()
                    self.replayed_bytes += window.replayed_bytes
                    self._save(version, self.combine(params, opt_state, extras), metadata)
                    self._pool.lend(version, window.buffers)
                    self.windows_completed += 1
                    window = None
            except WindowAborted as e:
                window = self._abort(window, str(e))
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                log.exception("checkpoint window failed")
                self._errors.append(e)
                window = self._abort(window, repr(e))

    def _save(self, version: int, tree: Any, metadata: dict | None) -> None:
        """``sink.save``, not losing this checkpoint to an *earlier* step's failure.

        A :class:`CheckpointStore` raises the unreported error of an earlier background
        persist from the next ``save`` and does not queue that save. Here that error is
        kept for the training thread (raised by :meth:`wait_until_finished`) and the save
        of ``version`` is retried, so a failed write costs one checkpoint, not two.
        """
        for _ in range(64):  # bounded: each retry reports one distinct earlier error
            try:
                self.sink.save(version, tree, metadata)
                return
            except CheckpointError as e:
                earlier = getattr(e, "step", None)
                if earlier is None or earlier == version:
                    raise
                log.error("checkpoint step %d failed earlier (%s); saving step %d anyway", earlier, e, version)
                self._errors.append(e)
        self.sink.save(version, tree, metadata)

    def _abort(self, window: WindowReplay | None, why: str) -> None:
        if window is not None:
            self.windows_aborted += 1
            log.warning("checkpoint window for step %d discarded: %s", window.version, why)
        return None
