"""The per-step API, saves and restores, queries and lifetime of :class:`CheckpointManager`; each
policy it composes has its module beside this one (:mod:`overlap_ckpt.manager`)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import jax

from ..core import backend
from ..core.engine import OverlapEngine
from ..core.window_context import set_planned
from ..doors.base import Door, Parts
from ..doors.registry import door_for
from ..errors import CheckpointFailure
from ..tiers import LocalTier
from .compile_ahead import SHARED_STEPS, AheadCall, CompileAhead, ahead_call
from .failures import FailureLog
from .handoff import Handoff
from .host_budget import BudgetSummary, Footprint, HostBudget, admit_window
from .options import ManagerOptions
from .save_tree import Arrange, SaveTree
from .window_choice import PredictedWindow, WindowChoice

log = logging.getLogger(__name__)


class CheckpointManager:
    """Overlapped checkpoints every ``save_interval_steps`` steps, Orbax-style names.

    Args:
      directory: where checkpoints go (any location :class:`CheckpointStore` accepts).
      save_interval_steps: checkpoint the state of every step that is a multiple of this.
        ``None`` opens the directory read-only, for :meth:`restore` and the queries.
      max_to_keep, keep_every_n_steps: retention, as in Orbax.
      window: steps K a checkpoint is spread over. ``"auto"``: 1 on the CPU backend, else
        predicted (:attr:`window_prediction`), then measured (:mod:`overlap_ckpt.manager.window_choice`).
      save_tree: a function rearranging the saved tree ``{"step", "params", "opt_state",
        **extras}`` into the app's own (see :mod:`overlap_ckpt.manager.save_tree`).
      item_name: the Orbax item the tree is saved as (Orbax's default is ``"default"``).
      on_error: ``"raise"`` (default): a failed background checkpoint raises
        :class:`CheckpointError` from the next :meth:`step`/:meth:`save`; ``"log"``: logged only.
      max_host_bytes: the host memory checkpoints may hold, earlier ones still in flight
        included (default 1.25x the state, or one checkpoint's need when more; less is
        refused at :meth:`prepare`). See :mod:`overlap_ckpt.manager.host_budget`.
      on_host_budget: when a window would exceed it: ``"wait"`` (default; the window's first
        step waits for earlier checkpoints, as Orbax's ``save`` does) or ``"skip"`` (not
        taken: :meth:`skipped_steps`). Counted in :meth:`summary`.
      store: an already-open :class:`CheckpointStore` instead of opening ``directory``.
      persist_bytes_per_s: storage bandwidth assumed by ``window="auto"``.
      local: a :class:`overlap_ckpt.LocalTier`: also checkpoint every ``local.every``
        steps to a node-local directory (the same host copy; see docs/tiers.md).
    """

    def __init__(self, directory: Any = None, *, save_interval_steps: int | None = None,
                 max_to_keep: int | None = None, keep_every_n_steps: int | None = None,
                 window: int | str = "auto", save_tree: Arrange | None = None, item_name: str = "default",
                 on_error: str = "raise", max_host_bytes: int | None = None, store: Any = None,
                 persist_bytes_per_s: float = 1e9, local: LocalTier | None = None,
                 on_host_budget: str = "wait"):
        self._options = options = ManagerOptions(save_interval_steps, max_to_keep, keep_every_n_steps, window,
                                                 item_name, on_error, persist_bytes_per_s, local)
        self._budget = HostBudget(max_host_bytes, on_host_budget)
        self.store = options.open_store(directory, store)
        self.directory = directory if directory is not None else self.store.directory
        self.save_interval_steps = save_interval_steps
        self.window = window
        self.persist_bytes_per_s = persist_bytes_per_s
        self.engine: OverlapEngine | None = None
        self._save_tree = SaveTree(save_tree)
        self._door: Door | None = None
        self._window = WindowChoice(window, options.capture_interval, persist_bytes_per_s)
        self._failures = FailureLog(self.directory)
        self._ahead = CompileAhead(lambda plan: self.engine.compile_replay(plan), self._window.read_schedule)
        self._handoff = Handoff(self, self._ahead,
                                admit=lambda first: admit_window(self._budget, self.engine, self.store, first))
        self._closed = False

    @property
    def window_prediction(self) -> PredictedWindow | None:
        """``window="auto"``'s K predicted from the step given to :meth:`compile_ahead`."""
        return self._window.prediction

    # -- the per-step API ------------------------------------------------------------------
    def prepare(self, state: Any, model: Any = None, *, graphdef: Any = None) -> Any:
        """Plan checkpoints for a fresh or restored state and return it ready for the first step.

        Linen: returns the state to train with (replicated states for ``jax.pmap`` are recognised).
        NNX: ``prepare(optimizer, model)``, updated in place and returned; functional NNX:
        ``prepare(state, graphdef=graphdef)``. One host sync. The optimizer is analysed and every
        phase of a window is replayed once on the host, so an optimizer or a state that cannot be
        checkpointed is refused here."""
        self._check_open()
        self._options.check_writable("prepare")
        door = door_for(state, model=model if model is not None else getattr(self._door, "model", None),
                        graphdef=graphdef)
        state = door.prepared(state)
        parts = door.parts(state)
        step = door.step_number(state)
        self._door = door
        self._ensure_engine(parts)
        self._save_tree.bind_door(door, parts)
        engine = self.engine
        engine.start(step)
        # Versions already on storage (a resume from an older step) are never captured again.
        for saved in self.store.all_steps():
            engine.windows.exclude(int(saved))
        engine.plan_for(parts.params, parts.opt_state, parts.extras)
        self._budget.bind(Footprint(*engine.footprint()))  # refuses a budget below one checkpoint
        set_planned(self, parts.tx)
        self._handoff.restart(step)
        self._window.restart()
        self._handoff.give(self.engine, door, state, step)
        return state

    def step(self, state: Any) -> Any:
        """Take the outbox of the step that produced ``state`` and ready the next step.

        Call once per training step, after the jitted step, with the state it returned (NNX: the
        optimizer; functional NNX: the ``nnx.State``). Returns the state to feed to the next step:
        outside checkpoint windows, the very object it was given.

        Raises :class:`CheckpointError` for background checkpoints that failed since the last call
        (``on_error="raise"``), before taking anything from ``state``: to go on training, handle it
        and call ``step(state)`` again."""
        self._check_open()
        self._raise_failures()
        ahead = self._ahead
        if not ahead.stepped:
            if self._door is not None:
                planned = self.engine.plan
                ahead.follow_first_step(state, replanned=lambda: self._plan_for(state) is not planned)
            ahead.first_step(self._ahead_job())
        ahead.raise_failure()
        if self._door is None:
            log.info("CheckpointManager.step called before prepare(); preparing now")
            return self.prepare(state)
        self.engine.release_idle_buffers()  # a persisted copy's memory goes back to the OS
        plain = self._handoff.sent is None
        state = self._handoff.take(self.engine, self._door, state)
        step = self._handoff.next_step
        if plain and self._window.adapting:
            k = self._window.observe(self._door.parts(state).params, step, self.engine.plan)
            if k is not None and self._use_window(k, state) and self._ahead.call is not None:
                self._ahead.start(self._ahead_job())
        self._handoff.give(self.engine, self._door, state, step)
        return state

    def jit_compiler_options(self, directory: str | None = None) -> dict[str, str]:
        """Opt-in, GPU: ``compiler_options`` for the step's ``jax.jit`` (``jax.jit(train_step,
        compiler_options=mngr.jit_compiler_options())``) with which :meth:`compile_ahead` starts
        every window copy at the top of the step, leaf by leaf, at no device memory (1B LM,
        compile-only H100: 877 copies, +1.4 MiB). What it costs and does not do, and the hints'
        ``directory``: :mod:`overlap_ckpt.manager.copy_schedule`. ``{}`` off a GPU."""
        self._check_open()
        return self._ahead.hint_options(directory, self.engine)

    def compile_ahead(self, step_fn: Any, *args: Any, **kwargs: Any) -> threading.Thread:
        """Compile the window variants of ``step_fn`` (a ``jax.jit``-ed step) in a background thread.

        Without this, the first step of each window phase compiles its variant on the training
        thread (K programs besides the user's own). Call it after :meth:`prepare` with the arguments
        of one call, the state among them (``mngr.compile_ahead(train_step, state, batch)``); it
        returns at once, and the variants compile after the first step, while plain steps run (when
        and why: :mod:`overlap_ckpt.manager.compile_ahead`). With ``window="auto"`` on an accelerator,
        K is first predicted from the step's flops (:func:`overlap_ckpt.costmodel.window.predict_window`),
        so the variants compiled are those every window will use; a K measured later compiles the same way."""
        self._check_open()
        if self._door is None:
            raise RuntimeError("compile_ahead: call prepare() first")
        ahead = self._ahead
        ahead.give(*ahead_call(step_fn, args, kwargs, self._door.is_state))
        SHARED_STEPS.add(self)
        k = self._window.predict(step_fn, args, kwargs, self.engine.plan)
        if k is not None:
            self._use_window(k, next(a for a in args if self._door.is_state(a)))
        return ahead.start(self._ahead_job() if ahead.stepped else None)

    def aot_report(self, step_fn: Any, *args: Any, target: Any = "h100", ks: Any = None, intervals: Any = None,
                   copy_hints: bool | None = None, **kwargs: Any) -> Any:
        """Compile-only, here: ``step_fn``'s window phases for the K this manager would use on ``target``
        ("h100", "v5e:2x2"...), checked and costed; arguments as for :meth:`compile_ahead` (docs/aot.md)."""
        from .aot_report import manager_report  # the aot package, imported only when asked
        return manager_report(self._door, self.window, self._options.capture_interval, self._ahead.hints is not None,
                              step_fn, args, kwargs, target=target, ks=ks, intervals=intervals, copy_hints=copy_hints)

    def compiling_ahead(self) -> tuple[AheadCall, Any, Any] | None:
        """The step given to :meth:`compile_ahead`, with this manager's window schedule and
        plan (for :class:`~overlap_ckpt.manager.compile_ahead.SharedSteps`); None before."""
        return self._ahead.windows_of(self.engine)

    def _ahead_job(self) -> Any:
        return SHARED_STEPS.job(self, skipped_variants=self._budget.on_full == "skip")

    @property
    def next_window_phase(self) -> int | None:
        """The window phase the next step captures (None: the next step is a plain step)."""
        return self._handoff.next_phase()

    def should_save(self, step: int) -> bool:
        interval = self.save_interval_steps
        return interval is not None and step > 0 and step % interval == 0

    # -- explicit saves and restores -------------------------------------------------------
    def save(self, step: int, state: Any, force: bool = False, *, model: Any = None,
             graphdef: Any = None) -> bool:
        """Synchronous snapshot of ``state`` as checkpoint ``step`` (e.g. at the end of training);
        the write itself is in the background. Returns False when nothing was saved: ``step`` is not
        a save step (and not ``force``), or it is already saved."""
        self._check_open()
        self._options.check_writable("save")
        self._raise_failures()
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        if step in self._handoff.captured or step in self.store.all_steps() or step in self.store.pending_steps():
            return False
        door = self._door or door_for(state, model=model, graphdef=graphdef)
        self.store.save(step, self._save_tree.bind_door(door, door.snapshot(state)), {"framework": door.name, "window": 0})
        if self.engine is not None:
            self.engine.windows.exclude(step)
        return True

    def restore(self, step: int | None = None, target_state: Any = None, *, model: Any = None,
                graphdef: Any = None) -> Any:
        """Read checkpoint ``step`` (latest when None).

        Without ``target_state``, returns the saved tree as numpy arrays, like Orbax. With one,
        reads into its structure, shapes, dtypes and shardings and returns it prepared for training
        (Linen: a new state; NNX: the optimizer and ``model=`` updated in place; functional NNX: a
        new ``nnx.State``, with ``graphdef=``). A mismatch of structure, shape or dtype raises an
        error naming the leaf."""
        self._check_open()
        step = int(step) if step is not None else self.store.step_to_restore()
        if target_state is None:
            tree, _ = self.store.restore(step)
            return tree
        door = door_for(target_state, model=model, graphdef=graphdef)
        target = door.restore_target(target_state)
        tree, _ = self.store.restore(step, target=self._save_tree.bind_door(door, target))
        state = door.restored(target_state, self._save_tree.read_parts(door, target, tree))
        if self.save_interval_steps is None:
            return state
        return self.prepare(state, model=model, graphdef=graphdef)

    # -- Orbax-like queries and lifetime ---------------------------------------------------
    def latest_step(self) -> int | None:
        latest = self.store.latest_step()
        if latest is None:
            self.store.check_not_foreign()
        return latest

    def all_steps(self) -> list[int]:
        return list(self.store.all_steps())

    def failed_steps(self) -> list[CheckpointFailure]:
        """Every checkpoint of this manager that failed, oldest first (raised or logged)."""
        self._failures.collect(self.engine, self.store)
        return self._failures.all()

    def skipped_steps(self) -> list[int]:
        """Checkpoint steps not taken because host memory or storage was still busy with an
        earlier one (``max_host_bytes`` with ``on_host_budget="skip"``, the store's back-pressure)."""
        return self.summary().skipped_steps

    def summary(self) -> BudgetSummary:
        """Checkpoints started, delayed and skipped for host memory so far (``print`` it);
        steps the store dropped count as skipped."""
        return self._budget.summary(dropped=self.store.dropped_steps)

    def wait_until_finished(self) -> None:
        """Block until every captured window is replayed and every checkpoint persisted;
        raise :class:`CheckpointError` for failures not reported yet (whatever ``on_error``)."""
        if self.engine is not None:
            self.engine.flush()
        self.store.flush()
        self._raise_failures(always=True)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            SHARED_STEPS.discard(self)
            self._handoff.withdraw()  # steps after the manager is gone are plain steps
            set_planned(self, None)
            self._ahead.close()  # a process must not exit in the middle of a compile
            if self.engine is not None:
                self.engine.close()
            self.store.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - do not hide the original exception
            if exc_type is None:
                raise
            log.exception("error while closing the CheckpointManager during another exception")

    def open_window(self) -> int | None:
        """The version of a window the next step would continue (phase > 0), if any: a
        window that cannot complete if training stops now (used on preemption)."""
        return self._handoff.open_window(self.engine)

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def _ensure_engine(self, parts: Parts) -> None:
        """An engine for ``parts``' optimizer and the door's memory kind (the one there, if it is)."""
        door, engine = self._door, self.engine
        if engine is not None:
            if engine.tx is parts.tx and engine.outbox_memory == backend.outbox_memory(door.outbox_memory):
                return
            engine.flush()
            engine.close()
        window = self._window.first_k(next(iter(jax.tree.leaves(parts.params)), None))
        save_tree, tx = self._save_tree, parts.tx
        self.engine = OverlapEngine(tx, self.store, interval=self._options.capture_interval, window=window,
                                    combine=lambda *trees: save_tree.saved(door, Parts(*trees, tx)),
                                    outbox_memory=door.outbox_memory, pack_outbox=self._ahead.pack_outbox)

    def _use_window(self, k: int, state: Any) -> bool:
        """Plan windows of ``k`` steps from the next one on; True when K changed."""
        if k == self.engine.schedule.k:
            return False
        self.engine.set_window(k)
        self._plan_for(state)
        return True

    def _plan_for(self, state: Any) -> Any:
        """The engine's plan for ``state`` (a new one when its tree or placement changed)."""
        parts = self._door.parts(state)
        return self.engine.plan_for(parts.params, parts.opt_state, parts.extras)

    def _raise_failures(self, always: bool = False) -> None:
        new = self._failures.collect(self.engine, self.store)
        self._failures.report(new, raise_them=always or self._options.on_error == "raise")


__all__ = ["CheckpointManager", "CheckpointFailure"]
