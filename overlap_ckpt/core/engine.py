"""The overlapped checkpoint engine: plans windows, replays them on the host, hands off.

The engine is framework-neutral. A training loop (or a door: Flax ``TrainState``, NNX
optimizer, :class:`overlap_ckpt.CheckpointManager`) asks it for the :class:`WindowTicket`
of each step (None outside windows), runs :func:`overlap_ckpt.capture_update` inside its
jitted step, and passes the outbox back with :meth:`OverlapEngine.submit`. A background
thread waits for the host copies, replays, and puts the consistent state of V into the
sink. The training thread never waits on it.

Failures of a window (a replay error, a sink that refuses a step) are kept, one record
per failed version, and handed to the training thread by :meth:`OverlapEngine.take_failures`
or raised by :meth:`OverlapEngine.wait_until_finished`; none is dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Collection, Protocol

import optax

from ..errors import CheckpointFailure, ConfigError, InternalError, UnsupportedOptimizerError, WindowAborted, brief
from ..gil import background
from .buffers import HostBuffers, trim_host_memory
from . import backend
from .ticket import Outbox, WindowTicket, unpacked
from .plan import CapturePlan, make_plan
from .replay import UNREPORTED_STEP, ReplayPrograms, WindowReplay
from .schedule import WindowSchedule, WindowTracker

log = logging.getLogger(__name__)

# What a sink holds besides the host copy while writing it: TensorStore references the
# copy's buffers (measured: 7-8 MiB above the copy while persisting 240 MB).
SINK_STAGING_BYTES = 16 << 20


class Sink(Protocol):
    """Receives the consistent host state of version ``step`` (trees of HostArray).

    ``put`` queues the tree (or raises for *this* step only: a step already saved, a tree
    that cannot be stored); it never refuses a step because an earlier one failed.
    ``busy_steps`` names the steps whose host copy the sink still reads: the engine reuses
    the buffers of a step once it is no longer busy.
    """

    def put(self, step: int, tree: Any, metadata: dict | None = None) -> None: ...

    def busy_steps(self) -> Collection[int]: ...


class MemorySink:
    """Keeps checkpoints in a dict; for tests and for callers that persist themselves."""

    def __init__(self) -> None:
        self.saved: dict[int, tuple[Any, dict | None]] = {}

    def put(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        self.saved[step] = (tree, metadata)

    def busy_steps(self) -> Collection[int]:
        return self.saved.keys()  # kept for good: never reused


class BufferPool:
    """Host copies of the state, reused across windows once the sink is done with them.

    Reuse matters: writing into freshly allocated memory page-faults on every page, which
    on a small host runs several times slower than writing into memory already touched.
    A copy's owned memory is its blocks and, with row chunks, its replay calls' outputs,
    which the next window's first calls write into (:attr:`HostBuffers.calls`).
    A lent copy may also hold views of captured arrays (see :class:`LeafBlocks`); they are
    released as soon as the sink is done (:meth:`release_idle`) and their memory is given
    back to the OS, so between windows the host holds the reused blocks and nothing else.
    """

    def __init__(self, sink: Sink, max_free: int = 1):
        self.sink = sink
        self.max_free = max_free
        self._lock = threading.Lock()
        self._lent: list[tuple[int, HostBuffers]] = []  # (step, buffers) handed to the sink
        self.holds_views = False  # some lent copy still references captured arrays

    def acquire(self, plan: CapturePlan) -> HostBuffers:
        busy = set(self.sink.busy_steps())
        with self._lock:
            for i, (step, buffers) in enumerate(self._lent):
                if step not in busy and buffers.plan == plan:
                    del self._lent[i]
                    buffers.release_views()
                    return buffers
        return HostBuffers(plan)

    def lend(self, step: int, buffers: HostBuffers) -> None:
        """Record that ``buffers`` were handed to the sink for ``step``."""
        with self._lock:
            self._lent.append((step, buffers))
            del self._lent[:-self.max_free]
            self.holds_views = True

    @property
    def kept_bytes(self) -> int:
        """Host memory kept for the next window: the owned blocks and replay outputs of the
        copies lent to the sink (what lies between windows, besides compiled programs)."""
        with self._lock:
            return sum(buffers.nbytes for _, buffers in self._lent)

    def release_idle(self) -> int:
        """Drop the captured arrays that copies the sink is done with still reference, and
        return their memory to the OS; returns the bytes dropped."""
        busy = set(self.sink.busy_steps())
        released = 0
        with self._lock:
            for step, buffers in self._lent:
                if step not in busy:
                    released += buffers.release_views()
            self.holds_views = any(b.adopted_bytes for _, b in self._lent)
        if released:
            trim_host_memory()
        return released


Combine = Callable[[Any, Any, Any], Any]


def default_combine(params, opt_state, extras) -> dict:
    """The saved tree when the caller does not give its own structure."""
    return {"params": params, "opt_state": opt_state, "extras": extras}


@dataclasses.dataclass
class _Phase:
    step: int
    outbox: Outbox
    programs: ReplayPrograms
    metadata: dict | None
    nbytes: int  # of the outbox as submitted: the replay empties it as it goes


class OverlapEngine:
    """Runs K-step windows every ``interval`` steps for one optax transformation.

    Args:
      tx: the optimizer the train step applies.
      sink: where consistent host copies go (:class:`overlap_ckpt.storage.CheckpointStore`,
        :class:`MemorySink`, the Orbax door's ``HostCopySink``).
      interval, window: checkpoint every ``interval`` steps, spread over ``window`` steps.
      chunk_leaves: None splits leaves into row chunks when the update allows it.
      combine: builds the saved tree from (params, opt_state, extras).
      outbox_memory: memory kind of the in-graph copies (default: the backend's host memory;
        None: device memory, for pmap).
      pack_outbox: one host copy per element width per window step instead of one per leaf
        (None: on GPU, and on TPU the small leaves; see :func:`overlap_ckpt.core.plan.make_plan`).
    """

    def __init__(self, tx: optax.GradientTransformation, sink: Sink, *, interval: int, window: int = 1,
                 chunk_leaves: bool | None = None, combine: Combine = default_combine,
                 outbox_memory: str | None = backend.HOST_MEMORY, pack_outbox: bool | None = None):
        self.tx = tx
        self.sink = sink
        self.windows = WindowTracker(WindowSchedule.clamped(interval, window))
        self.chunk_leaves = chunk_leaves
        self.combine = combine
        self.outbox_memory = backend.outbox_memory(outbox_memory)
        self.pack_outbox = pack_outbox
        self.plan: CapturePlan | None = None
        self._programs: dict[CapturePlan, ReplayPrograms] = {}
        self._queue: queue.Queue = queue.Queue()
        self._pool = BufferPool(sink)
        self._held_lock = threading.Lock()
        self._queued_bytes = 0  # captured bytes submitted, not yet received by the worker
        self._window_bytes = 0  # host memory of the window being replayed
        self._release_queued = False
        self._failures: collections.deque[CheckpointFailure] = collections.deque()
        self.windows_completed = 0
        self.windows_aborted = 0
        self.replay_seconds = 0.0  # host time spent receiving and replaying phases
        self.replayed_bytes = 0  # state bytes advanced by replay, over completed windows
        self.apply_seconds = 0.0  # of replay_seconds, the time in replay calls (copy-in excluded)
        # Optional timeline hook (benchmarks): set to a list to get one
        # (step, phase, start, end) tuple of time.perf_counter() per received phase.
        self.spans: list | None = None
        self._closed = False
        self._worker = threading.Thread(target=background(self._run), name="overlap-ckpt-replay", daemon=True)
        self._worker.start()

    # -- training thread ----------------------------------------------------------------
    @property
    def schedule(self) -> WindowSchedule:
        return self.windows.schedule

    def phase(self, step: int) -> int | None:
        """The window phase of ``step`` (None outside windows)."""
        return self.windows.phase(step)

    def ticket(self, step: int) -> WindowTicket | None:
        """What the jitted step of ``step`` takes in place of an outbox: None outside windows.

        Every step of a scheduled window gets a ticket, even one whose window this run does
        not capture (see :class:`WindowTracker`); :meth:`submit` drops what is not wanted.
        Needs a plan (:meth:`plan_for`); at phase 0 of every window, call :meth:`plan_for`
        with the current state first if its structure or placement may have changed (a jit
        without ``out_shardings`` may move leaves after the first step).
        """
        phase = self.windows.phase(step)
        if phase is None:
            return None
        if self.plan is None:
            raise RuntimeError("OverlapEngine.ticket: no plan yet; call plan_for(params, opt_state, extras)")
        version = self.schedule.version(step, phase)
        return WindowTicket(self.plan, phase, capture=not self.windows.is_skipped(version))

    def start(self, step: int) -> None:
        """A run starts (or resumes) at ``step``: a window already under way is not captured.
        A new run has no window open: a partial one of a previous run is discarded."""
        self._queue.put(("abort", f"training restarted at step {step}"))
        self.windows.restart(step)

    def set_window(self, window: int) -> None:
        """Use windows of ``window`` steps from the next window on (e.g. once auto-K has
        measured the step); the next :meth:`plan_for` re-plans for it."""
        self.windows.schedule = WindowSchedule.clamped(self.schedule.interval, window)
        self.plan = None

    def copy_per_leaf(self) -> None:
        """Copy each leaf on its own, no packing, from the next window step on (GPU, with the
        copy schedule hint: :mod:`overlap_ckpt.manager.copy_schedule`). A packed plan becomes
        the same plan unpacked; its host replay carries over, since the replay reads every
        outbox unpacked (:func:`overlap_ckpt.core.ticket.unpacked`)."""
        self.pack_outbox = False
        plan = self.plan
        if plan is not None and plan.pack_outbox:
            self.plan = dataclasses.replace(plan, pack_outbox=False, pack_max_bytes=None)
            if plan in self._programs:  # an outbox of the packed plan still finds its replay
                self._programs[self.plan] = self._programs[plan]

    def plan_for(self, params, opt_state, extras=None) -> CapturePlan:
        """The plan for this state, re-planned when its structure, shapes or dtypes changed.

        A new plan is rehearsed on the host (every phase's replay, on zeros of the real
        shapes) before it is used, so an optimizer that cannot be replayed is refused here.
        """
        if self.plan is not None:
            mismatch = self.plan.matches(params, opt_state, extras)
            if mismatch is None:
                return self.plan
            if mismatch.moved:  # expected once after prepare when jit picks its output shardings
                log.info("re-planning the checkpoint window: %s", mismatch.why)
            else:
                log.warning("train state changed (%s); the open window is discarded and the next one re-planned",
                            mismatch.why)
            self._queue.put(("abort", "the train state changed"))
        def plan_with(chunk_leaves):
            return make_plan(self.tx, params, opt_state, extras, self.schedule.k,
                             chunk_leaves=chunk_leaves, outbox_memory=self.outbox_memory,
                             pack_outbox=self.pack_outbox)

        plan = plan_with(self.chunk_leaves)
        try:
            self._rehearse(plan)
        except (InternalError, ConfigError):
            raise  # a fault of ours, or of the set-up: another slicing would hide it, not fix it
        except Exception as e:  # noqa: BLE001 - any other failure here means: cannot replay this way
            if not plan.chunked:
                raise _unreplayable(e) from e
            log.info("row-chunked replay is not exact for this optimizer (%s); using whole-leaf slices", brief(e))
            plan = plan_with(False)
            try:
                self._rehearse(plan)
            except Exception as e2:  # noqa: BLE001
                raise _unreplayable(e2) from e2
        if plan.k != self.schedule.k:  # fewer rows than steps: the schedule adopts the plan's K
            self.windows.schedule = WindowSchedule(self.schedule.interval, plan.k)
        self.plan = plan
        return plan

    def _rehearse(self, plan: CapturePlan) -> None:
        programs = self._programs.get(plan)
        if programs is None:
            programs = ReplayPrograms(plan)
            programs.rehearse()
        self._programs = {plan: programs}  # phases in flight hold their own reference

    def compile_replay(self, plan: CapturePlan | None = None) -> None:
        """Compile the host replay programs of ``plan`` (default: the current one) now (see
        :meth:`ReplayPrograms.compile`) and give the compiler's working memory back. A plan
        replaced meanwhile (the training thread re-planned) is not compiled: no window will
        replay it."""
        plan = plan or self.plan
        if plan is None:
            raise RuntimeError("OverlapEngine.compile_replay: no plan yet (call plan_for first)")
        programs = self._programs.get(plan)
        if programs is None:
            return
        programs.compile()
        trim_host_memory()

    def submit(self, step: int, outbox: Outbox, metadata: dict | None = None) -> bool:
        """Hand a step's outbox to the host worker and return at once; False when the outbox
        is not wanted (a window this run does not capture) and was dropped."""
        if self._closed:  # no worker would take it: the checkpoint would be lost without a word
            raise RuntimeError(f"OverlapEngine.submit: the engine is closed; the outbox of step {step} "
                               "was not taken. Submit before close(), or make a new engine.")
        ticket = outbox.ticket
        if not ticket.capture or not self.windows.captures(step, ticket.phase):
            return False
        programs = self._programs.get(ticket.plan)
        if programs is None:
            raise RuntimeError("OverlapEngine.submit: the outbox was captured with a plan this engine "
                               "did not make (use the engine's ticket for the step)")
        nbytes = outbox_bytes(outbox)
        with self._held_lock:
            self._queued_bytes += nbytes
        self._queue.put(("phase", _Phase(step, outbox, programs, metadata, nbytes)))
        return True

    def held_bytes(self) -> int:
        """Host memory of checkpoints not yet handed to the sink: captured outboxes waiting
        for the worker and the window being replayed (the sink counts its own)."""
        with self._held_lock:
            return self._queued_bytes + self._window_bytes

    def footprint(self) -> tuple[int, int]:
        """(copy, scratch): the bytes of one host copy of the current plan's state, and the
        most the replay and the sink hold besides it (see :mod:`overlap_ckpt.manager.host_budget`)."""
        plan = self.plan
        extras = sum(layout.rows * layout.row_bytes for layout in plan.extras)
        return plan.state_bytes + extras, self._programs[plan].scratch_bytes() + SINK_STAGING_BYTES

    @property
    def kept_host_bytes(self) -> int:
        """Host memory kept between windows for reuse (see :class:`BufferPool`)."""
        return self._pool.kept_bytes

    def release_idle_buffers(self) -> None:
        """Free the host memory of copies the sink has finished with, on the worker thread
        (it returns memory to the OS, which the training thread should not wait for). Cheap
        when nothing is held: call it every step."""
        if not self._pool.holds_views or self._release_queued:
            return
        self._release_queued = True
        self._queue.put(("release", None))

    def take_failures(self) -> list[CheckpointFailure]:
        """Failures recorded since the last call (each one exactly once), oldest first."""
        out = []
        while self._failures:
            out.append(self._failures.popleft())
        return out

    def flush(self) -> None:
        """Block until every submitted phase is processed (failures stay recorded). After
        :meth:`close` there is nothing left to wait for: it processed every phase first."""
        if self._closed:
            return
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait()

    def wait_until_finished(self) -> None:
        """:meth:`flush`, then raise the oldest unreported failure (the others stay for
        :meth:`take_failures`)."""
        self.flush()
        if self._failures:
            raise self._failures.popleft().error

    def close(self) -> None:
        """Process every submitted phase, then stop the worker."""
        self._closed = True
        if self._worker.is_alive():
            self._queue.put(("stop", None))
            self._worker.join()

    # -- worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        window: WindowReplay | None = None
        while True:
            kind, item = self._queue.get()
            if kind == "stop":
                return
            if kind == "flush":
                item.set()
                continue
            if kind == "abort":  # a restart or a re-plan: the loop's own doing, not a failure
                window = self._abort(window, item)
                continue
            if kind == "release":
                self._release_queued = False
                self._pool.release_idle()
                continue
            ticket = item.outbox.ticket
            version = WindowSchedule(self.schedule.interval, ticket.plan.k).version(item.step, ticket.phase)
            try:
                if ticket.phase == 0:
                    if window is not None:
                        self._abort(window, f"the window of step {version} started before this one ended. "
                                            f"{UNREPORTED_STEP}", failed=True)
                    window = WindowReplay(ticket.plan, self._pool.acquire(ticket.plan), version, item.programs)
                if window is None or window.plan != ticket.plan or window.version != version:
                    continue  # joined mid-window (e.g. after a resume): wait for the next one
                start = time.perf_counter()
                window.receive(unpacked(item.outbox))
                end = time.perf_counter()
                self._set_window_bytes(window.buffers.held_bytes)
                self.replay_seconds += end - start
                if self.spans is not None:
                    self.spans.append((item.step, ticket.phase, start, end))
                if window.complete:
                    done, window = window, None
                    self._hand_off(done, item.metadata)
                    del done  # the pool and the sink hold the copy now, nothing else
            except WindowAborted as e:
                window = self._abort(window, str(e), failed=True)
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                log.error("checkpoint window of step %d failed: %s: %s", version, type(e).__name__, brief(e))
                self._failures.append(CheckpointFailure(version, "replay", e))
                window = self._abort(window, repr(e))
            finally:
                with self._held_lock:
                    self._queued_bytes -= item.nbytes
                if window is None:
                    self._set_window_bytes(0)
            # Hold no captured array past its use: host memory has room for one copy.
            item = None

    def _set_window_bytes(self, n: int) -> None:
        with self._held_lock:
            self._window_bytes = n

    def _hand_off(self, window: WindowReplay, metadata: dict | None) -> None:
        params, opt_state, extras = window.result()
        self.replayed_bytes += window.replayed_bytes
        self.apply_seconds += window.apply_seconds
        try:
            self.sink.put(window.version, self.combine(params, opt_state, extras), metadata)
        except BaseException as e:  # noqa: BLE001 - this step only: the sink refused it
            log.error("checkpoint step %d was not handed to storage: %s: %s", window.version,
                      type(e).__name__, brief(e))
            self._failures.append(CheckpointFailure(window.version, "handoff", e))
            return
        self._pool.lend(window.version, window.buffers)
        self.windows_completed += 1

    def _abort(self, window: WindowReplay | None, why: str, *, failed: bool = False) -> None:
        """Discard ``window``. ``failed``: the checkpoint the loop asked for is lost for a
        reason of the loop's (a step not reported, a state changed outside the optimizer),
        which is recorded as a failure, so that it reaches the user at the next call as
        Orbax's failed saves do, rather than only in a log line."""
        if window is not None:
            self.windows_aborted += 1
            log.warning("checkpoint window for step %d discarded: %s", window.version, why)
            if failed:
                self._failures.append(CheckpointFailure(window.version, "window", WindowAborted(
                    f"the checkpoint window of step {window.version} was discarded: {why}")))
        return None


def outbox_bytes(outbox: Outbox) -> int:
    """Host bytes of the captured arrays of an outbox (this process's shards)."""
    return sum(s.data.nbytes for x in (*outbox.state, *outbox.grads, *outbox.extras, *outbox.packed)
               for s in x.addressable_shards)


def _unreplayable(e: BaseException) -> UnsupportedOptimizerError | InternalError:
    if isinstance(e, (UnsupportedOptimizerError, InternalError)):
        return e
    return UnsupportedOptimizerError(
        f"the host cannot replay this optimizer on slices of the state ({type(e).__name__}: "
        f"{brief(e)}). Use window=1, or an optimizer from docs/optimizers.md.")
