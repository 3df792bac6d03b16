"""``CheckpointManager``: the Orbax-like front door of overlapped checkpointing.

One object owns the storage (:class:`overlap_ckpt.storage.CheckpointStore`), the overlap
engine (:class:`overlap_ckpt.core.engine.OverlapEngine`) and the door of the loop's state
style (:mod:`overlap_ckpt.doors`). The training loop calls :meth:`CheckpointManager.step`
once per step, after its jitted step. Outside checkpoint windows that call returns the
state it was given and the step is the user's own program; in a window the manager takes
the step's outbox, hands it to the engine and gives the next step its window ticket. It
never waits on the device: the step number is read once (:meth:`prepare`) and counted on
the host afterwards.

Failures of background work (a replay, a write, a full disk) are raised as
:class:`overlap_ckpt.errors.CheckpointError` from the next :meth:`step` or :meth:`save`
(``on_error="raise"``, the default, like Orbax's async saves) or logged
(``on_error="log"``); either way every failed step is kept in :meth:`failed_steps`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import weakref
from typing import Any

import jax

from . import autok
from .autok import AutoWindow
from .compile_ahead import AheadCall, AheadJob, CompileAhead
from .copy_schedule import CopyScheduleHints
from .core.capture import Outbox, WindowTicket
from .core import backend
from .core.engine import OverlapEngine
from .core.fallback import capture_before_step
from .core.window_context import hand_to_next_step, set_planned, shared_step_keys, window_ticket
from .doors.abstract import abstract_arguments, after_the_step, graph_nodes
from .doors.base import Door, Parts, standard_tree
from .doors.registry import door_for
from .errors import CheckpointError, CheckpointFailure, ConfigError
from .host_budget import BudgetSummary, Footprint, HostBudget
from .save_tree import Arrange, SaveTree
from .tiers import LocalTier, TieredStore

log = logging.getLogger(__name__)

# Open managers given a step to compile ahead: a step shared by several runs under their
# tickets together where windows meet (see CheckpointManager._ahead_job).
_COMPILING_AHEAD: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()

_KEEP_TRACEBACKS = 16  # failures older than this keep their message, not their frames


class CheckpointManager:
    """Overlapped checkpoints every ``save_interval_steps`` steps, Orbax-style names.

    Args:
      directory: where checkpoints go (any location :class:`CheckpointStore` accepts).
      save_interval_steps: checkpoint the state of every step that is a multiple of this.
        ``None`` opens the directory read-only, for :meth:`restore` and the queries.
      max_to_keep, keep_every_n_steps: retention, as in Orbax.
      window: steps K a checkpoint is spread over. ``"auto"``: 1 on the CPU backend; on
        accelerators K is chosen by the cost model: before the first window from the
        step's own program when it is given to :meth:`compile_ahead` on a known device
        (H100, TPU v4/v5e/v5p/v6e; the prediction is :attr:`window_prediction`), else K=1;
        then from the measured step time and device-to-host bandwidth, once measured.
      save_tree: a function rearranging the saved tree ``{"step", "params", "opt_state",
        **extras}`` into the app's own (see :mod:`overlap_ckpt.save_tree`).
      item_name: the Orbax item the tree is saved as (Orbax's default is ``"default"``).
      on_error: ``"raise"`` (default): a failed background checkpoint raises
        :class:`CheckpointError` from the next :meth:`step`/:meth:`save`; ``"log"``: logged only.
      max_host_bytes: the host memory checkpoints may hold: host copies, replay and writer
        buffers, copies of earlier checkpoints still in flight (default 1.25x the state, or
        what one checkpoint needs when that is more). Less than one checkpoint needs is
        refused at :meth:`prepare` with the minimum. See :mod:`overlap_ckpt.host_budget`.
      on_host_budget: when a window would exceed ``max_host_bytes`` because earlier
        checkpoints are still being written: ``"wait"`` (default; the step that starts the
        window waits for them, as Orbax's ``save`` does, and no checkpoint is lost) or
        ``"skip"`` (the checkpoint is not taken; :meth:`skipped_steps`). Each one is logged
        once and counted in :meth:`summary`.
      store: an already-open :class:`CheckpointStore` instead of opening ``directory``.
      persist_bytes_per_s: storage bandwidth assumed by ``window="auto"``.
      local: a :class:`overlap_ckpt.tiers.LocalTier`: also checkpoint every ``local.every``
        steps to a node-local directory (the same host copy; see docs/tiers.md).
    """

    def __init__(self, directory: Any = None, *, save_interval_steps: int | None = None,
                 max_to_keep: int | None = None, keep_every_n_steps: int | None = None,
                 window: int | str = "auto", save_tree: Arrange | None = None, item_name: str = "default",
                 on_error: str = "raise", max_host_bytes: int | None = None, store: Any = None,
                 persist_bytes_per_s: float = 1e9, local: LocalTier | None = None,
                 on_host_budget: str = "wait"):
        if save_interval_steps is not None and (isinstance(save_interval_steps, bool) or not isinstance(
                save_interval_steps, int) or save_interval_steps < 1):
            raise ConfigError(f"save_interval_steps must be an int >= 1 (or None to only restore), "
                              f"got {save_interval_steps!r}")
        if window != "auto" and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"window must be 'auto' or an int >= 1, got {window!r}")
        if on_error not in ("raise", "log"):
            raise ConfigError(f"on_error must be 'raise' or 'log', got {on_error!r}")
        self._budget = HostBudget(max_host_bytes, on_host_budget)
        if local is not None:
            if not isinstance(local, LocalTier):
                raise ConfigError(f"local must be an overlap_ckpt.LocalTier, got {type(local).__name__}")
            local.check_interval(save_interval_steps)
        if store is None:
            if directory is None:
                raise ConfigError("CheckpointManager needs a directory (or store=)")
            from .storage import CheckpointStore
            store = CheckpointStore(directory, max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps,
                                    item_name=item_name, read_only=save_interval_steps is None)
        if local is not None:
            try:
                store = TieredStore(store, local, save_interval_steps)
            except BaseException:
                store.close()
                raise
        self.store = store
        # Windows run at the local tier's interval; the store routes durable steps onward.
        self._capture_interval = local.every if local is not None and save_interval_steps else save_interval_steps
        self.directory = directory if directory is not None else store.directory
        self.save_interval_steps = save_interval_steps
        self.window = window
        self.on_error = on_error
        self.max_host_bytes = max_host_bytes
        self.persist_bytes_per_s = persist_bytes_per_s
        self.engine: OverlapEngine | None = None
        self._save_tree = SaveTree(save_tree)
        self._door: Door | None = None
        self._auto: AutoWindow | None = None
        self.window_prediction: autok.PredictedWindow | None = None  # window="auto" from the program
        self._next_step: int | None = None  # version of the input state of the next step
        self._sent: WindowTicket | None = None  # the ticket given to the next step
        self._extras: list | None = None  # extras copied before the next step (doors that need it)
        self._failures: list[CheckpointFailure] = []
        self._ahead = CompileAhead(lambda plan: self.engine.compile_replay(plan))
        self._captured: collections.deque[int] = collections.deque(maxlen=16)  # versions whose window completed capture
        self._closed = False

    # -- the per-step API ------------------------------------------------------------------
    def prepare(self, state: Any, model: Any = None, *, graphdef: Any = None) -> Any:
        """Plan checkpoints for a fresh or restored state and return it ready for the first step.

        Linen: returns the state to train with (replicated states for ``jax.pmap`` are
        recognised). NNX: ``prepare(optimizer, model)``, updated in place and returned;
        functional NNX: ``prepare(state, graphdef=graphdef)``. One host sync. The optimizer
        is analysed and every phase of a window is replayed once on the host, so an
        optimizer or a state that cannot be checkpointed is refused here.
        """
        self._check_open()
        self._check_writable("prepare")
        door = door_for(state, model=model if model is not None else getattr(self._door, "model", None),
                        graphdef=graphdef)
        state = door.prepared(state)
        parts = door.parts(state)
        step = door.step_number(state)
        self._door = door
        self._ensure_engine(parts)
        self._save_tree.bind(door.plain(standard_tree(parts)))
        engine = self.engine
        engine.start(step)
        # Versions already on storage (a resume from an older step) are never captured again.
        for saved in self.store.all_steps():
            engine.windows.exclude(int(saved))
        engine.plan_for(parts.params, parts.opt_state, parts.extras)
        self._budget.bind(Footprint(*engine.footprint()))  # refuses a budget below one checkpoint
        set_planned(self, parts.tx)
        self._next_step = step
        if self._auto is not None:
            self._auto.restart()
        if self._sent is not None:  # prepared again in the middle of a window
            hand_to_next_step(self, None)
            self._sent = None
        return self._attach(state, step)

    def step(self, state: Any) -> Any:
        """Take the outbox of the step that produced ``state`` and ready the next step.

        Call once per training step, after the jitted step, with the state it returned
        (NNX: the optimizer; functional NNX: the ``nnx.State``). Returns the state to feed
        to the next step: outside checkpoint windows, the very object it was given.

        Raises :class:`CheckpointError` for background checkpoints that failed since the
        last call (``on_error="raise"``), before taking anything from ``state``: to go on
        training, handle it and call ``step(state)`` again.
        """
        self._check_open()
        self._raise_failures()
        ahead = self._ahead
        if not ahead.stepped:
            self._follow_the_first_step(state)
            ahead.first_step(self._ahead_job())
        ahead.raise_failure()
        if self._door is None:
            log.info("CheckpointManager.step called before prepare(); preparing now")
            return self.prepare(state)
        sent, t = self._sent, self._next_step
        self.engine.release_idle_buffers()  # a persisted copy's memory goes back to the OS
        if sent is not None:
            outbox, state = self._door.take_outbox(state)
            self._receive(t, sent, outbox)
        self._next_step = t + 1
        if self._auto is not None and sent is None:
            self._observe(state, t + 1)
        return self._attach(state, t + 1)

    def jit_compiler_options(self, directory: str | None = None) -> dict[str, str]:
        """Opt-in, GPU: ``compiler_options`` for the step's ``jax.jit`` that let
        :meth:`compile_ahead` start the last window phase's host copy at the top of the step.

        ``jax.jit(train_step, donate_argnums=0, compiler_options=mngr.jit_compiler_options())``,
        then :meth:`compile_ahead` with that step. XLA:GPU otherwise starts the copy after
        most of the step's compute and the step waits for the rest: measured on an H200 (1B LM,
        K=1), 0.15-0.17 s of a 0.24 s step, 0.00-0.03 s with the hint. The price: the outbox
        (for K=1, the state's size) in device memory through the whole step, a second
        background compile of each last phase, and XLA's warnings about instructions the
        hint does not name. Only variants compiled by :meth:`compile_ahead` are hinted; the
        plain step and the phases that ship gradients compile as without the option. See
        :mod:`overlap_ckpt.copy_schedule`. Elsewhere than on a GPU: ``{}``.
        ``directory``: where the hints go (default: a new temporary directory)."""
        self._check_open()
        platform = backend.platform_of(jax.devices()[0])
        if platform != "gpu":
            log.info("jit_compiler_options: the default backend is %s, not a GPU; no hint", platform)
            return {}
        if self._ahead.hints is None or (directory is not None and directory != self._ahead.hints.directory):
            self._ahead.hints = CopyScheduleHints(directory)
        return self._ahead.hints.compiler_options()

    def compile_ahead(self, step_fn: Any, *args: Any, **kwargs: Any) -> threading.Thread:
        """Compile the window variants of ``step_fn`` in a background thread.

        Without this, the first step of each window phase compiles its variant on the
        training thread (K programs besides the user's own, seconds to minutes each for a
        large model). Call it after :meth:`prepare` with the jitted step and the arguments
        of one call, the prepared state among them (``mngr.compile_ahead(train_step, state,
        batch)``); it returns at once. The variants compile while plain steps run, starting
        after the first step, so that two compiles of the whole step never hold their memory
        at the same time. A window reached before they are done (a loop that does not sync
        every step dispatches that far within milliseconds) waits for them rather than
        compiling them again. ``step_fn`` must be a ``jax.jit``-ed function (it needs ``.lower``).
        With ``window="auto"`` on an accelerator, the step is first lowered here (traced, not
        compiled) and K chosen from its flops (:func:`overlap_ckpt.autok.predict_window`),
        so the variants compiled are those of the K every window will use. When
        ``window="auto"`` changes K later (measured), the new variants compile the same way.
        With ``on_host_budget="skip"`` the variants a skipped window runs (the same update,
        no copies) compile too.
        """
        self._check_open()
        if self._door is None:
            raise RuntimeError("compile_ahead: call prepare() first")
        if not hasattr(step_fn, "lower"):
            raise TypeError(f"compile_ahead needs a jax.jit-ed or nnx.jit-ed step function (with "
                            f".lower), got {type(step_fn).__name__}")
        if not any(self._door.is_state(a) for a in args):
            raise TypeError("compile_ahead: none of the arguments is a state of the kind this manager "
                            "prepared; pass the arguments of one call of the step, the state among them")
        ahead = self._ahead
        _COMPILING_AHEAD.add(self)
        ahead.give(AheadCall(step_fn, *abstract_arguments(args, kwargs)),
                   (graph_nodes(args), [i for i, a in enumerate(args) if self._door.is_state(a)]))
        if self._auto is not None:
            self._predict_window(next(a for a in args if self._door.is_state(a)))
        return ahead.start(self._ahead_job() if ahead.stepped else None)

    def _follow_the_first_step(self, state: Any) -> None:
        """Before the variants given to :meth:`compile_ahead` compile: when the first step
        moved a leaf (a jit without ``out_shardings``), plan again and take the call's
        arguments as the step left them (:func:`overlap_ckpt.doors.abstract.after_the_step`),
        so that what compiles ahead is what the windows run."""
        ahead = self._ahead
        live, ahead.live = ahead.live, None
        if live is None or self._door is None:
            return
        planned = self.engine.plan
        parts = self._door.parts(state)
        if self.engine.plan_for(parts.params, parts.opt_state, parts.extras) is planned:
            return
        ahead.call = ahead.call._replace(args=after_the_step(ahead.call.args, *live, state))

    def _predict_window(self, state: Any) -> None:
        """``window="auto"``: K from the plain step's program, before any window. The
        measurement still runs: a prediction rests on a datasheet and an assumed MFU, so
        when the measured step gives another K, the windows after it use that one."""
        step_fn, args, kwargs = self._ahead.call
        plan = self.engine.plan
        sharding = plan.params[0].sharding
        with window_ticket(None):  # the user's own program, whatever the next step captures
            lowered = step_fn.lower(*args, **kwargs)
        state_bytes, grad_bytes = self._bytes_per_device()
        predicted = autok.predict_window(lowered, next(iter(sharding.addressable_devices)),
                                         len(sharding.device_set), state_bytes, grad_bytes,
                                         self.persist_bytes_per_s, self._capture_interval)
        if predicted is None:
            return
        self.window_prediction = predicted
        self._use_window(predicted.k, state)

    def _ahead_job(self) -> AheadJob | None:
        """What to compile ahead, read on the training thread: a later step may re-plan
        (``window="auto"``) while the compile thread runs, and the engine has no plan for a
        moment then. None when no step was given to :meth:`compile_ahead`.

        When other managers were given the same step, it runs under their tickets too where
        windows meet: the variants are then those of every combination of window phases that
        includes this manager's (each manager compiles those with its own; the ones both
        compile are compiled once and found in jit's cache by the other)."""
        call = self._ahead.call
        if call is None:
            return None
        plan = self.engine.plan
        # This manager and every other given the same step (one jitted step updating several
        # managers' states, a GAN); compile_ahead put each in _COMPILING_AHEAD.
        sharing = {m: (m.engine.schedule, m.engine.plan) for m in list(_COMPILING_AHEAD)
                   if m._ahead.call is not None and m._ahead.call.step_fn is call.step_fn
                   and m.engine.plan is not None}
        tickets = shared_step_keys(self, sharing)
        if self._budget.on_full == "skip":
            # A skipped window's steps run variants that copy nothing; a skip comes when the
            # host is already short of memory, the worst moment for a compile on the
            # training thread. ("wait" never runs them for lack of memory.)
            tickets += [WindowTicket(plan, phase, capture=False) for phase in range(plan.k)]
        return AheadJob(call, plan, tickets)

    @property
    def next_window_phase(self) -> int | None:
        """The window phase the next step captures (None: the next step is a plain step)."""
        return None if self._sent is None else self._sent.phase

    def should_save(self, step: int) -> bool:
        interval = self.save_interval_steps
        return interval is not None and step > 0 and step % interval == 0

    # -- explicit saves and restores -------------------------------------------------------
    def save(self, step: int, state: Any, force: bool = False, *, model: Any = None,
             graphdef: Any = None) -> bool:
        """Synchronous snapshot of ``state`` as checkpoint ``step`` (e.g. at the end of
        training); the write itself is in the background. Returns False when nothing was
        saved: ``step`` is not a save step (and not ``force``), or it is already saved.
        """
        self._check_open()
        self._check_writable("save")
        self._raise_failures()
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        if step in self._captured or step in self.store.all_steps() or step in self.store.pending_steps():
            return False
        door = self._door or door_for(state, model=model, graphdef=graphdef)
        tree = door.plain(standard_tree(door.snapshot(state)))
        self._save_tree.bind(tree)
        self.store.save(step, self._save_tree.to_saved(tree), {"framework": door.name, "window": 0})
        if self.engine is not None:
            self.engine.windows.exclude(step)
        return True

    def restore(self, step: int | None = None, target_state: Any = None, *, model: Any = None,
                graphdef: Any = None) -> Any:
        """Read checkpoint ``step`` (latest when None).

        Without ``target_state``, returns the saved tree as numpy arrays, like Orbax. With
        one, reads into its structure, shapes, dtypes and shardings and returns it prepared
        for training (Linen: a new state; NNX: the optimizer and ``model=`` updated in
        place; functional NNX: a new ``nnx.State``, with ``graphdef=``). A mismatch of
        structure, shape or dtype raises an error naming the leaf.
        """
        self._check_open()
        step = self._restorable(step)
        if target_state is None:
            tree, _ = self.store.restore(step)
            return tree
        door = door_for(target_state, model=model, graphdef=graphdef)
        target = door.restore_target(target_state)
        like = standard_tree(target)
        self._save_tree.bind(door.plain(like))
        tree, _ = self.store.restore(step, target=self._save_tree.to_saved(door.plain(like)))
        tree = door.unplain(self._save_tree.to_standard(tree), like)
        restored = {k: v for k, v in tree.items() if k not in ("params", "opt_state")}
        state = door.restored(target_state, Parts(tree["params"], tree["opt_state"], restored, target.tx))
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
        self._collect()
        return list(self._failures)

    def skipped_steps(self) -> list[int]:
        """Checkpoint steps not taken because host memory or storage was still busy with an
        earlier one (``max_host_bytes`` with ``on_host_budget="skip"``, the store's back-pressure)."""
        return sorted(set(self._budget.summary().skipped_steps) | set(getattr(self.store, "dropped_steps", [])))

    def summary(self) -> BudgetSummary:
        """Checkpoints started, delayed and skipped for host memory so far (``print`` it);
        steps the store dropped count as skipped."""
        summary = self._budget.summary()
        summary.skipped_steps = self.skipped_steps()
        return summary

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
            _COMPILING_AHEAD.discard(self)
            hand_to_next_step(self, None)  # steps after the manager is gone are plain steps
            set_planned(self, None)
            self._ahead.close()  # a process must not exit in the middle of a compile
            if self.engine is not None:
                self.engine.close()
            self.store.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - do not hide the original exception
            log.exception("error while closing the CheckpointManager during another exception")

    def open_window(self) -> int | None:
        """The version of a window the next step would continue (phase > 0), if any: a
        window that cannot complete if training stops now (used on preemption)."""
        if self.engine is None or self._next_step is None:
            return None
        return self.engine.windows.open_window(self._next_step)

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")

    def _check_writable(self, what: str) -> None:
        if self.save_interval_steps is None:
            raise ConfigError(f"CheckpointManager.{what}: this manager was opened without "
                              "save_interval_steps, for restoring only; pass save_interval_steps= to train.")

    def _ensure_engine(self, parts: Parts) -> None:
        door = self._door
        if self.engine is not None and self.engine.tx is parts.tx \
                and self.engine.outbox_memory == backend.outbox_memory(door.outbox_memory):
            return
        if self.engine is not None:
            self.engine.flush()
            self.engine.close()
        window = self.window
        self._auto = None
        if window == "auto":
            window = 1
            leaves = jax.tree.leaves(parts.params)
            auto = AutoWindow(self._capture_interval, self.persist_bytes_per_s)
            if leaves and auto.wants_measurement(leaves[0]):
                self._auto = auto
        save_tree = self._save_tree

        def saved_tree(params, opt_state, extras):
            return save_tree.to_saved(door.plain(standard_tree(Parts(params, opt_state, extras, parts.tx))))

        self.engine = OverlapEngine(parts.tx, self.store, interval=self._capture_interval, window=window,
                                    combine=saved_tree, outbox_memory=door.outbox_memory)

    def _attach(self, state: Any, step: int) -> Any:
        """Give the step whose input is ``state`` (version ``step``) its ticket, if any."""
        engine = self.engine
        phase = engine.phase(step)
        if phase is None:
            if self._sent is not None:
                hand_to_next_step(self, None)
                self._sent = None
            return state
        if phase == 0:
            parts = self._door.parts(state)
            engine.plan_for(parts.params, parts.opt_state, parts.extras)  # re-plans if the tree changed
            if engine.phase(step) == 0 and engine.windows.captures(step, 0):  # the plan may lower K
                self._check_host_memory(step)
        self._ahead.await_variants()
        ticket = engine.ticket(step)
        self._sent = ticket
        self._extras = None
        if ticket.last and ticket.capture and not self._door.extras_in_step \
                and engine.windows.captures(step, ticket.phase):
            self._extras = capture_before_step(ticket, self._door.parts(state).extras)
        hand_to_next_step(self, ticket)
        return state

    def _check_host_memory(self, step: int) -> None:
        """Admit the window of ``step``'s version under the host budget: wait for earlier
        checkpoints or skip it (:class:`HostBudget`)."""
        engine = self.engine
        self._budget.bind(Footprint(*engine.footprint()))  # the plan may have changed

        def held() -> int:
            return self.store.held_bytes() + engine.held_bytes()

        def wait() -> None:
            engine.flush()
            self.store.flush()
            engine.release_idle_buffers()
            engine.flush()

        version = engine.schedule.version(step, 0)
        if not self._budget.admit(version, held, wait):
            engine.windows.skip(version)

    def _receive(self, t: int, sent: WindowTicket, outbox: Any) -> None:
        if outbox is None:
            raise RuntimeError(
                f"step {t} is in phase {sent.phase} of a checkpoint window but the state carries no "
                "outbox: call CheckpointManager.step exactly once per training step, on the thread "
                "that runs the step, with the state returned by a step that called apply_gradients "
                "(NNX: optimizer.update) with the optimizer this manager prepared.")
        if not isinstance(outbox, Outbox) or outbox.ticket != sent:
            raise RuntimeError(f"the outbox of step {t} is not the one this manager asked for "
                               f"(phase {getattr(getattr(outbox, 'ticket', None), 'phase', '?')}, "
                               f"expected {sent.phase})")
        if self._extras is not None:
            outbox = dataclasses.replace(outbox, extras=self._extras)
        if self.engine.submit(t, outbox, {"framework": self._door.name, "window": sent.plan.k}) and sent.last:
            self._captured.append(self.engine.schedule.version(t, sent.phase))

    def _observe(self, state: Any, step: int) -> None:
        leaf = jax.tree.leaves(self._door.parts(state).params)[0]
        k = self._auto.observe(leaf, step, *self._bytes_per_device())
        if k is None:
            return
        self._auto = None
        if self._use_window(k, state) and self._ahead.call is not None:
            self._ahead.start(self._ahead_job())

    def _bytes_per_device(self) -> tuple[float, float]:
        """State and gradient bytes one device copies in a window: this process's blocks
        over its devices (each copies its own shards over its own link)."""
        plan = self.engine.plan
        devices = len(plan.params[0].sharding.addressable_devices)
        return plan.state_bytes / devices, plan.grad_bytes / devices

    def _use_window(self, k: int, state: Any) -> bool:
        """Plan windows of ``k`` steps from the next one on; True when K changed."""
        if k == self.engine.schedule.k:
            return False
        self.engine.set_window(k)
        parts = self._door.parts(state)
        self.engine.plan_for(parts.params, parts.opt_state, parts.extras)
        return True

    def _restorable(self, step: int | None) -> int | None:
        if step is not None:
            return int(step)
        if isinstance(self.store, TieredStore):  # collective: the processes agree on the step,
            return None  # skipping local steps one of them cannot read (TieredStore.restore)
        latest = self.latest_step()
        if latest is None:
            from .storage import CheckpointNotFoundError
            raise CheckpointNotFoundError(f"no checkpoint in {self.directory}", path=str(self.directory))
        return self.store.latest_intact_step()

    def _collect(self) -> list[CheckpointFailure]:
        new = []
        if self.engine is not None:
            new += self.engine.take_failures()
        new += [CheckpointFailure(getattr(e, "step", None), "persist", e) for e in self.store.take_errors()]
        if new:
            self._failures += new
            for old in self._failures[:-_KEEP_TRACEBACKS]:
                _drop_traceback(old.error)  # frames of a failed persist hold its host copy alive
        return new

    def _raise_failures(self, always: bool = False) -> None:
        new = self._collect()
        if not new:
            return
        if self.on_error == "log" and not always:
            for failure in new:
                log.error("checkpoint %s", failure)
            return
        lines = "; ".join(str(f) for f in new[:5]) + (f"; and {len(new) - 5} more" if len(new) > 5 else "")
        error = CheckpointError(
            f"{len(new)} checkpoint(s) failed in the background: {lines}. Training can go on; "
            "mngr.failed_steps() lists every failure. Fix the cause (e.g. free disk space) for the "
            "next checkpoints, or pass on_error='log' to keep training without this exception.",
            step=new[0].step, path=str(self.directory), failures=tuple(new))
        raise error from new[0].error


def _drop_traceback(error: BaseException | None) -> None:
    while error is not None and error.__traceback__ is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


__all__ = ["CheckpointManager", "CheckpointFailure"]
