"""Compiling a step's window variants on a background thread, and its hand-offs with training.

Why a unit of its own: the compile is simple (lower and compile the user's step once per
window ticket, then the host replay), but when it may run and what the training thread
does about it are not, and they were spread through the manager:

* it starts only after the first step has run, so that it never holds XLA's working
  memory while the user's own program compiles (two compiles of the whole step at once),
  and it compiles the arguments as that step left them (:meth:`CompileAhead.first_step`);
* a window step waits for the variants instead of compiling them again beside it
  (:meth:`CompileAhead.await_variants`);
* a variant that does not compile is raised by the next step, long before the first window
  (:meth:`CompileAhead.raise_failure`);
* a manager closing waits for the compile, because a process must not exit in the middle of
  one (:meth:`CompileAhead.close`).

What to compile (the plan, the call) is the manager's: it knows the door and the engine;
this unit runs the jobs it is given (:class:`AheadJob`), and finds the tickets a step shared
by several managers runs under (:class:`SharedSteps`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple, Protocol

import jax

from ..core import backend
from ..core.buffers import trim_host_memory
from ..core.plan import CapturePlan
from ..core.schedule import WindowSchedule
from ..core.ticket import WindowTicket
from ..core.window_context import shared_step_keys, window_ticket
from ..doors.abstract import abstract_arguments, after_the_step, graph_nodes
from ..errors import ConfigError, brief
from .copy_schedule import CopyScheduleHints

log = logging.getLogger(__name__)


class AheadCall(NamedTuple):
    """The step given to ``compile_ahead`` and the abstract arguments of one of its calls."""

    step_fn: Any
    args: tuple
    kwargs: dict


class AheadJob(NamedTuple):
    """One background compile: the variant of ``call`` for each ticket, then the host replay
    of ``plan`` (each ticket is one window phase of that plan; a tuple of tickets, the phases
    of several managers' windows that one shared step runs at once)."""

    call: AheadCall
    plan: CapturePlan
    tickets: list[WindowTicket | tuple[WindowTicket, ...]]


class CompileAhead:
    """The background compiles of one manager's window variants.

    ``compile_replay(plan)`` compiles the host replay's programs of ``plan`` (the engine's,
    read when the variants are done: the manager may have a new engine by then);
    ``read_schedule(plan, phase, compiled)`` is given each variant compiled that copies a
    phase of the manager's own ``plan`` (``window="auto"`` reads where its copies are
    scheduled).
    """

    def __init__(self, compile_replay: Callable[[CapturePlan], None],
                 read_schedule: Callable[[CapturePlan, int, jax.stages.Compiled], None] = lambda *_: None):
        self._compile_replay = compile_replay
        self._read_schedule = read_schedule
        self.call: AheadCall | None = None  # the latest step given to compile_ahead
        self.live: tuple | None = None  # its NNX objects and state positions, until the first step
        self._first_job: AheadJob | None = None  # what compiles ahead, as the first step left it
        self._stepped = threading.Event()  # set once the training thread has run a step
        self._ready = threading.Event()  # the latest compile's variants are compiled (or moot)
        self._ready.set()
        self._error: BaseException | None = None  # a window variant that failed to compile
        self._threads: list[threading.Thread] = []  # joined at close
        self._closed = False
        # Set by CheckpointManager.jit_compiler_options: capturing phases get a copy schedule hint.
        self.hints: CopyScheduleHints | None = None

    @property
    def stepped(self) -> bool:
        """Whether the training thread has run its first step (a lock-free read)."""
        return self._stepped.is_set()

    def give(self, call: AheadCall, live: tuple | None) -> None:
        """Take the step to compile; ``live``: what :meth:`follow_first_step` needs to follow
        the first step's placement (kept only when that step has not run yet)."""
        self.call = call
        if not self.stepped:
            self.live = live

    def windows_of(self, engine: Any) -> tuple[AheadCall, WindowSchedule, CapturePlan] | None:
        """The call to compile with the schedule and plan of ``engine``'s windows (the
        manager's :meth:`SharesSteps.compiling_ahead`); None without a call or a plan."""
        if self.call is None or engine is None or engine.plan is None:
            return None
        return self.call, engine.schedule, engine.plan

    def follow_first_step(self, state: Any, replanned: Callable[[], bool]) -> None:
        """Before the variants compile: when the first step moved a leaf (a jit without
        ``out_shardings``; ``replanned()`` plans again and says whether the plan changed),
        take the call's arguments as the step left them
        (:func:`overlap_ckpt.doors.abstract.after_the_step`), so that what compiles ahead
        is what the windows run."""
        live, self.live = self.live, None
        if live is not None and replanned():
            self.call = self.call._replace(args=after_the_step(self.call.args, *live, state))

    def hint_options(self, directory: str | None, engine: Any = None) -> dict[str, str]:
        """``CheckpointManager.jit_compiler_options``: the copy schedule hint's compiler
        options on a GPU (its hints in ``directory``), ``{}`` elsewhere. The hinted windows
        copy leaf by leaf: ``engine`` (the manager's, if it has one yet) switches now, an
        engine made later is made so (:attr:`pack_outbox`)."""
        platform = backend.platform_of(jax.devices()[0])
        if platform != "gpu":
            log.info("jit_compiler_options: the default backend is %s, not a GPU; no hint", platform)
            return {}
        if self.hints is None or (directory is not None and directory != self.hints.directory):
            self.hints = CopyScheduleHints(directory)
        if engine is not None:
            engine.copy_per_leaf()
        return self.hints.compiler_options()

    @property
    def pack_outbox(self) -> bool | None:
        """The ``pack_outbox`` of the manager's engine: False (one copy per leaf) once the
        copy schedule hint is on, else None (the platform's default)."""
        return False if self.hints is not None else None

    def first_step(self, job: AheadJob | None) -> None:
        """The training thread's first step has run: compiles waiting for it may start, with
        ``job`` (read now, on the training thread) when they were given none."""
        self._first_job = job
        self._stepped.set()

    def start(self, job: AheadJob | None) -> threading.Thread:
        """Compile ``job`` in a background thread, once the first step has run (``None``
        before it: the job is what :meth:`first_step` is given)."""
        first_step = self._stepped
        ready = self._ready = threading.Event()

        def run() -> None:
            try:
                first_step.wait()  # the user's own program is compiled (and its memory freed)
                picked = job or self._first_job
                if picked is None:  # closed before the first step
                    return
                step_fn, args, kwargs = picked.call
                for ticket in picked.tickets:
                    if self._closed:
                        return
                    with window_ticket(ticket):
                        lowered = step_fn.lower(*args, **kwargs)
                        hints = self.hints
                        if hints is not None and hints.wanted(ticket):
                            hints.prepare(lowered)  # before the compile the step's jit keeps
                        compiled = lowered.compile()
                    own = next((t.phase for t in (ticket if isinstance(ticket, tuple) else (ticket,))
                                if isinstance(t, WindowTicket) and t.plan is picked.plan and t.capture), None)
                    if own is not None:
                        self._read_schedule(picked.plan, own, compiled)
                    # XLA frees a compile's working memory in pieces that glibc keeps in its
                    # arenas: measured on the 20M LM, K=3, 1.3x the state stayed resident
                    # after the variants compiled, until the process ended.
                    trim_host_memory()
                ready.set()
                self._compile_replay(picked.plan)
            except Exception as e:  # noqa: BLE001 - raised by the next step(), long before the window
                self._error = e
            finally:
                ready.set()

        thread = threading.Thread(target=run, name="overlap-ckpt-compile-ahead", daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def await_variants(self) -> None:
        """Before a window step: wait for the variants being compiled.

        Why: a loop that does not sync every step reaches the first window as fast as it
        dispatches, possibly before the variants are compiled. The window step then compiled
        its variant again on the training thread, beside the background compile of the same
        program: on the 20M LM, K=3, loss fetched every 5 steps, the training thread spent
        2.7x the plain loop's compile time. Waiting costs at most the rest of that compile.
        Before the first step (a second ``prepare``) the compile has not started: no wait."""
        ready = self._ready
        if ready.is_set() or not self.stepped:
            return
        start = time.perf_counter()
        ready.wait()
        log.info("window step waited %.2f s for compile_ahead's variants", time.perf_counter() - start)

    def raise_failure(self) -> None:
        """Raise a variant's compile failure as the :class:`ConfigError` it is (once)."""
        if self._error is None:
            return
        error, self._error = self._error, None
        raise ConfigError(
            f"the window variant of the train step does not compile ({type(error).__name__}: "
            f"{brief(error)}); this step would fail at the first checkpoint window. See "
            "docs/porting.md for the supported loop styles.") from error

    def close(self) -> None:
        """Stop before the next variant and wait for the one compiling."""
        self._closed = True
        self._stepped.set()  # a compile still waiting for the first step: let it see it is moot
        for thread in self._threads:
            thread.join()


def ahead_call(step_fn: Any, args: tuple, kwargs: dict, is_state: Callable[[Any], bool]) -> tuple[AheadCall, tuple]:
    """The step given to ``compile_ahead`` with abstract arguments of one call, and what
    :meth:`CompileAhead.follow_first_step` needs (their NNX objects, which arguments are the
    state: ``is_state``); refused when it cannot be compiled ahead."""
    if not hasattr(step_fn, "lower"):
        raise TypeError(f"compile_ahead needs a jax.jit-ed or nnx.jit-ed step function (with "
                        f".lower), got {type(step_fn).__name__}")
    if not any(is_state(a) for a in args):
        raise TypeError("compile_ahead: none of the arguments is a state of the kind this manager "
                        "prepared; pass the arguments of one call of the step, the state among them")
    return (AheadCall(step_fn, *abstract_arguments(args, kwargs)),
            (graph_nodes(args), [i for i, a in enumerate(args) if is_state(a)]))


class SharesSteps(Protocol):
    """What :class:`SharedSteps` asks of a manager that compiles a step ahead."""

    def compiling_ahead(self) -> tuple[AheadCall, WindowSchedule, CapturePlan] | None:
        """The call given to ``compile_ahead`` with the schedule and plan of the windows it
        runs in (None: none given, or no plan yet)."""


class SharedSteps:
    """The open managers given a step to compile ahead, held weakly.

    Why a registry: one jitted step may update several managers' states (a GAN's two
    optimizers); where their windows meet it runs under the tickets of both, so each
    manager's variants are every combination of phases that includes its own
    (:func:`~overlap_ckpt.core.window_context.shared_step_keys`). The ones both compile are
    compiled once and found in jit's cache by the other.
    """

    def __init__(self) -> None:
        self._owners: "weakref.WeakSet[SharesSteps]" = weakref.WeakSet()

    def add(self, owner: SharesSteps) -> None:
        self._owners.add(owner)

    def discard(self, owner: SharesSteps) -> None:
        self._owners.discard(owner)

    def job(self, owner: SharesSteps, skipped_variants: bool) -> AheadJob | None:
        """What ``owner`` compiles ahead, read on the training thread (a later step may
        re-plan while the compile thread runs). ``skipped_variants``: also the variants a
        window skipped for host memory runs (the same update, no copies), which come when
        the host is already short of memory, the worst moment to compile on the training
        thread. None when ``owner`` was given no step."""
        own = owner.compiling_ahead()
        if own is None:
            return None
        call, _, plan = own
        windows = {o: (w[1], w[2]) for o in list(self._owners)
                   if (w := o.compiling_ahead()) is not None and w[0].step_fn is call.step_fn}
        windows[owner] = own[1:]
        tickets = shared_step_keys(owner, windows)
        if skipped_variants:
            tickets += [WindowTicket(plan, phase, capture=False) for phase in range(plan.k)]
        return AheadJob(call, plan, tickets)


SHARED_STEPS = SharedSteps()
