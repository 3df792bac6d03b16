"""Overlapped checkpoints saved through a team's own ``ocp.CheckpointManager``.

For code that keeps its ``orbax.checkpoint.CheckpointManager`` (its options, retention,
metrics, preemption handling), overlap_ckpt plugs in through Orbax's own extension points:
a :class:`CheckpointHandler` registered for a :class:`CheckpointArgs` type in the manager's
``handler_registry``. Usage::

    import orbax.checkpoint as ocp
    import overlap_ckpt as oc

    copies = oc.HostCopySink()                              # the engine's sink
    engine = oc.OverlapEngine(tx, copies, interval=100, window=3)
    mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(...),
                                 handler_registry=oc.overlap_handler_registry())
    for step in range(num_steps):
        phase = engine.phase(step)
        params, opt_state, outbox = train_step(plan, phase, params, opt_state, ...)
        if phase is not None:
            engine.submit(step, phase, outbox)
            if phase == plan.k - 1:                         # last phase of the window of `step`
                mngr.save(step, args=oc.OverlapSave(copies.take(step)))   # returns at once
    mngr.wait_until_finished()

What :class:`OverlapSave` carries: the consistent host copy of version ``step`` that the
engine replayed (a tree of :class:`~overlap_ckpt.hostarray.HostArray` / numpy leaves), or a
future of it (:meth:`HostCopySink.take`). The handler's ``async_save`` only validates and
returns; the future is awaited and the arrays are written by Orbax's background commit
thread, with overlap_ckpt's storage writer (:mod:`overlap_ckpt.storage.writer`), in the
exact layout of ``ocp.StandardCheckpointHandler`` (OCDBT + zarr3, ``_METADATA``). The
handler reports Orbax's standard handler type in the step metadata, so a *stock*
``ocp.CheckpointManager(directory).restore(step)`` restores the checkpoint without
importing overlap_ckpt.

Honest limits:

* single process (``jax.process_count() == 1``); multi-host jobs use
  :class:`overlap_ckpt.CheckpointManager` (whose store merges per-process databases);
* ``OverlapSave`` writes host copies only: a device ``jax.Array`` leaf is refused (it could
  be donated by the next step while being written); save those with ``ocp.args.StandardSave``
  (routed by :func:`overlap_handler_registry` to Orbax's own handler);
* restoring through a manager built with this registry needs explicit args
  (``args=ocp.args.StandardRestore(abstract_tree)``); a stock manager needs none.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import future as _ocp_future

from ..errors import WindowAborted
from ..hostarray import HostArray
from ..storage import layout, persist, writer
from ..storage.location import LocalLocation, open_location, root_context
from ..storage.tree import to_leaves

__all__ = ["OverlapSave", "OverlapCheckpointHandler", "HostCopySink", "overlap_handler_registry"]

_DEFAULT_TIMEOUT_S = 600.0


@dataclasses.dataclass
class OverlapSave(ocp.args.CheckpointArgs):
    """Save args: a host copy produced by overlap_ckpt, or a future of one.

    Attributes:
      item: a tree whose array leaves are :class:`HostArray` or numpy arrays/scalars (what
        an :class:`~overlap_ckpt.engine.OverlapEngine` sink receives), or a
        ``concurrent.futures.Future`` resolving to such a tree (:meth:`HostCopySink.take`).
        The buffers are referenced, not copied, until the write ends: do not modify them.
      timeout_s: how long the background commit waits for a future ``item``.
      chunk_bytes: target size of a zarr chunk.
    """

    item: Any
    timeout_s: float = _DEFAULT_TIMEOUT_S
    chunk_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        # Refuse device arrays here, in the caller's thread: an error raised later, inside
        # Orbax's save, would leave Orbax's step-directory signal waiting until it times out.
        if not isinstance(self.item, concurrent.futures.Future):
            _refuse_device_arrays(self.item)


class HostCopySink:
    """An engine sink that hands each replayed host copy to an Orbax save.

    The engine (worker thread) calls :meth:`put`; the training loop calls :meth:`take`
    for a version and gets a ``concurrent.futures.Future`` of its tree, which
    :class:`OverlapSave` accepts, so ``mngr.save`` never waits for the replay. Windows
    finish in order, so when version V completes, every still-unresolved earlier version
    was aborted: its future fails with :class:`~overlap_ckpt.errors.WindowAborted`.

    Copies nobody takes are kept (at most ``max_unclaimed``, oldest dropped first), so
    taking a version after its window finished works too.
    """

    def __init__(self, max_unclaimed: int = 2):
        if not isinstance(max_unclaimed, int) or max_unclaimed < 0:
            raise ValueError(f"max_unclaimed must be an int >= 0, got {max_unclaimed!r}")
        self.max_unclaimed = max_unclaimed
        self._lock = threading.Lock()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._unclaimed: list[int] = []  # completed versions not taken yet, oldest first
        self._recent: collections.deque[int] = collections.deque(maxlen=16)  # steps put, newest last
        self.metadata: dict[int, dict | None] = {}

    def put(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        step = int(step)
        with self._lock:
            self._recent.append(step)
            fut = self._futures.get(step)
            if fut is None or fut.done():
                fut = self._futures[step] = concurrent.futures.Future()
                self._unclaimed.append(step)
                while len(self._unclaimed) > self.max_unclaimed:
                    self._futures.pop(self._unclaimed.pop(0), None)
            self.metadata[step] = metadata
            earlier = [(s, f) for s, f in self._futures.items() if s < step and not f.done()]
            for s, _ in earlier:
                del self._futures[s]
        fut.set_result(tree)
        for s, f in earlier:
            f.set_exception(WindowAborted(f"the checkpoint window of step {s} was discarded "
                                          f"(a later window, step {step}, completed first)"))

    def busy_steps(self) -> list[int]:
        """Every step put so far: Orbax writes a taken copy on its own thread and does not say
        when it is done, so the engine never reuses the buffers of a copy handed out here."""
        with self._lock:
            return list(self._recent)

    def take(self, step: int) -> concurrent.futures.Future:
        """The future host copy of version ``step`` (forgotten by the sink from now on)."""
        step = int(step)
        with self._lock:
            fut = self._futures.pop(step, None)
            if fut is None:
                fut = concurrent.futures.Future()
                self._futures[step] = fut  # resolved by save(); removed then by take's caller
                fut.add_done_callback(lambda _f, s=step: self._forget(s, _f))
            elif step in self._unclaimed:
                self._unclaimed.remove(step)
            self.metadata.pop(step, None)
        return fut

    def _forget(self, step: int, fut: concurrent.futures.Future) -> None:
        with self._lock:
            if self._futures.get(step) is fut:
                del self._futures[step]
            if step in self._unclaimed:
                self._unclaimed.remove(step)


class OverlapCheckpointHandler(ocp.handlers.AsyncCheckpointHandler):
    """Writes :class:`OverlapSave` host copies in ``StandardCheckpointHandler``'s layout.

    ``ocp.args.StandardSave`` / ``StandardRestore`` are delegated to an inner
    ``ocp.StandardCheckpointHandler``, so one registry entry per args type serves a
    manager's overlapped saves, its ordinary synchronous saves and its restores.
    """

    def __init__(self, standard: ocp.StandardCheckpointHandler | None = None):
        self._standard = standard or ocp.StandardCheckpointHandler()
        self._pending_standard: set[str] = set()  # item dirs whose save went to _standard

    @classmethod
    def typestr(cls) -> str:
        # The step metadata records the handler that can *read* the item: the layout is
        # StandardCheckpointHandler's, so stock Orbax restores it without overlap_ckpt.
        return ocp.StandardCheckpointHandler.typestr()

    # -- save -----------------------------------------------------------------------------
    async def async_save(self, directory: epath.Path, args: Any = None, **kwargs):
        if isinstance(args, ocp.args.StandardSave):
            self._pending_standard.add(str(directory))
            return await self._standard.async_save(directory, args=args, **kwargs)
        args = _check_args(args)
        if not isinstance(args.item, concurrent.futures.Future):
            _prepare(args.item, args.chunk_bytes)  # errors surface in mngr.save, not later
        return [_ocp_future.CommitFutureAwaitingContractedSignals(
            _write_async(directory, args), name="overlap_ckpt_write")]

    def save(self, directory: epath.Path, args: Any = None, **kwargs) -> None:
        if isinstance(args, ocp.args.StandardSave):
            self._pending_standard.add(str(directory))
            return self._standard.save(directory, args=args, **kwargs)
        args = _check_args(args)
        write_host_tree(directory, _resolve(args))

    # -- restore and the rest: Orbax's standard handler ------------------------------------
    def restore(self, directory: epath.Path, args: Any = None) -> Any:
        if args is not None and not isinstance(args, ocp.args.StandardRestore):
            raise TypeError(f"OverlapCheckpointHandler restores with ocp.args.StandardRestore, got "
                            f"{type(args).__name__}")
        return self._standard.restore(directory, args=args)

    def metadata(self, directory: epath.Path) -> Any:
        return self._standard.metadata(directory)

    def finalize(self, directory: epath.Path) -> None:
        key = str(directory)
        if key in self._pending_standard:
            self._pending_standard.discard(key)
            self._standard.finalize(directory)
        # OverlapSave: the commit future already merged the database and wrote the metadata.

    def close(self) -> None:
        self._standard.close()


def overlap_handler_registry(item: str = "default",
                             registry: ocp.handlers.DefaultCheckpointHandlerRegistry | None = None,
                             handler: OverlapCheckpointHandler | None = None):
    """A handler registry (new, or ``registry`` extended) routing ``OverlapSave``,
    ``StandardSave`` and ``StandardRestore`` of ``item`` to one :class:`OverlapCheckpointHandler`.

    ``item="default"`` is the item name ``ocp.CheckpointManager`` uses for single-item
    ``save(step, args=...)``; for ``args=ocp.args.Composite(...)`` pass the item's name.
    """
    registry = registry if registry is not None else ocp.handlers.DefaultCheckpointHandlerRegistry()
    handler = handler or OverlapCheckpointHandler()
    registry.add(item, OverlapSave, handler)
    registry.add(item, ocp.args.StandardSave, handler)
    registry.add(item, ocp.args.StandardRestore, handler)
    return registry


# -- the write ------------------------------------------------------------------------------

def _check_args(args: Any) -> OverlapSave:
    if not isinstance(args, OverlapSave):
        raise TypeError(f"OverlapCheckpointHandler saves OverlapSave or ocp.args.StandardSave, got "
                        f"{type(args).__name__}")
    if jax.process_count() != 1:
        raise NotImplementedError(
            "OverlapSave is single-process for now; multi-host jobs use "
            "overlap_ckpt.CheckpointManager, whose store merges per-process databases.")
    return args


def _resolve(args: OverlapSave) -> Any:
    item = args.item
    if isinstance(item, concurrent.futures.Future):
        try:
            return item.result(timeout=args.timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise TimeoutError(
                f"OverlapSave waited {args.timeout_s}s for the host copy of its window; was the "
                "window's last phase submitted to the engine (engine.submit)?") from e
    return item


async def _write_async(directory: epath.Path, args: OverlapSave) -> None:
    tree = await asyncio.to_thread(_resolve, args)
    await asyncio.to_thread(write_host_tree, directory, tree, chunk_bytes=args.chunk_bytes)


def _refuse_device_arrays(tree: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, HostArray))[0]:
        if isinstance(leaf, jax.Array):
            raise TypeError(
                f"OverlapSave: leaf {jax.tree_util.keystr(path)} is a jax.Array; OverlapSave writes "
                "host copies made by overlap_ckpt (HostArray/numpy). Save device arrays with "
                "ocp.args.StandardSave, which copies them off the device first.")


def _prepare(tree: Any, chunk_bytes: int):
    """Flatten and validate (no copy): the tree's leaves and the arrays to write, checked
    by the storage writer so both doors refuse the same trees with the same messages."""
    _refuse_device_arrays(tree)
    leaves = to_leaves(tree)
    return leaves, writer.prepare_arrays(leaves, chunk_bytes)


def write_host_tree(directory: epath.Path | str, tree: Any, *, step: int | None = None,
                    chunk_bytes: int = 4 << 20, batch_bytes: int = 1 << 30) -> None:
    """Write a host tree into the Orbax item directory ``directory`` (which exists or is
    created) in ``StandardCheckpointHandler``'s layout: the arrays into an OCDBT database
    merged into the item root, then ``_METADATA`` (and overlap_ckpt's ``_overlap_ckpt.json``,
    which Orbax ignores). Returns once everything is durable. Orbax commits the step."""
    leaves, arrays = _prepare(tree, chunk_bytes)
    path = str(directory).rstrip("/")
    parent, _, item_rel = path.rpartition("/")
    context = writer.make_context(root_context())
    location = open_location(parent or "/", context)
    if step is None:  # Orbax's step directory: "<step>" or "<step>.orbax-checkpoint-tmp..."
        parsed = layout.parse_step_name(parent.rpartition("/")[2])
        step = parsed[0] if parsed else 0
    persist.write_item(location, item_rel, step, leaves, arrays, context, batch_bytes=batch_bytes)
    if isinstance(location, LocalLocation):
        location.sync_tree(item_rel)
