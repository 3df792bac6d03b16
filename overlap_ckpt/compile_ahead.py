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

What to compile (the plan, the tickets, the call) is the manager's: it knows the door, the
engine and the host budget; this unit only runs the jobs it is given (:class:`AheadJob`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, NamedTuple

from .copy_schedule import CopyScheduleHints
from .core.buffers import trim_host_memory
from .core.capture import WindowTicket
from .core.plan import CapturePlan
from .core.window_context import window_ticket
from .errors import ConfigError, brief

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
    read when the variants are done: the manager may have a new engine by then).
    """

    def __init__(self, compile_replay: Callable[[CapturePlan], None]):
        self._compile_replay = compile_replay
        self.call: AheadCall | None = None  # the latest step given to compile_ahead
        self.live: tuple | None = None  # its NNX objects and state positions, until the first step
        self._first_job: AheadJob | None = None  # what compiles ahead, as the first step left it
        self._stepped = threading.Event()  # set once the training thread has run a step
        self._ready = threading.Event()  # the latest compile's variants are compiled (or moot)
        self._ready.set()
        self._error: BaseException | None = None  # a window variant that failed to compile
        self._threads: list[threading.Thread] = []  # joined at close
        self._closed = False
        # Set by CheckpointManager.jit_compiler_options: last phases get a copy schedule hint.
        self.hints: CopyScheduleHints | None = None

    @property
    def stepped(self) -> bool:
        """Whether the training thread has run its first step (a lock-free read)."""
        return self._stepped.is_set()

    def give(self, call: AheadCall, live: tuple | None) -> None:
        """Take the step to compile; ``live``: what :meth:`first_step` needs to follow the
        first step's placement (kept only when that step has not run yet)."""
        self.call = call
        if not self.stepped:
            self.live = live

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
                        lowered.compile()
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
