"""The contract between the manager and the store it checkpoints into, written down.

Two stores implement it: :class:`~overlap_ckpt.storage.CheckpointStore` (one directory) and
:class:`~overlap_ckpt.tiers.store.TieredStore` (a local tier beside a durable one). Before it
was written, the manager probed for what a store could do (``getattr(store,
"dropped_steps")``, ``isinstance(store, TieredStore)``) and a third store would have failed
at run time, in the middle of a job; now the manager and preemption call only what is here,
and ``tests/storage/test_protocol.py`` checks that both stores have all of it.

The engine's side of it is :class:`~overlap_ckpt.core.engine.Sink` (``put``, ``busy_steps``):
a store is a sink with the rest below.
"""

from __future__ import annotations

from typing import Any, Collection, Protocol, runtime_checkable


@runtime_checkable
class Store(Protocol):
    """What :class:`~overlap_ckpt.CheckpointManager` needs of the store behind it."""

    @property
    def directory(self) -> str:
        """Where the (durable) checkpoints are, for messages."""

    @property
    def dropped_steps(self) -> Collection[int]:
        """Steps the store dropped without writing them (its back-pressure)."""

    # -- writing: the engine's sink, and a synchronous snapshot's save ----------------------
    def put(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """Queue the consistent host tree of ``step`` (a window's), by reference."""

    def save(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """Queue a tree the caller hands over (``CheckpointManager.save``)."""

    def busy_steps(self) -> Collection[int]:
        """Steps whose host copy the store still reads."""

    def pending_steps(self) -> list[int]:
        """Steps queued or being written."""

    def held_bytes(self) -> int:
        """Host bytes the store holds for steps not written yet (the host budget counts them)."""

    def take_errors(self) -> list:
        """Failures of background writes since the last call (each raised once)."""

    def flush(self) -> None:
        """Block until every queued step is written (or has failed)."""

    # -- reading ---------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """Committed steps, ascending."""

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""

    def step_to_restore(self) -> int | None:
        """The step ``restore(None)`` should read, checked now: the newest intact step, or
        None where the store decides it within :meth:`restore` (collectively, for a tiered
        store). Raises ``CheckpointNotFoundError`` when there is none."""

    def check_not_foreign(self) -> None:
        """Raise when the directory holds another format's checkpoints and none of ours."""

    def restore(self, step: int | None = None, target: Any = None) -> tuple[Any, dict]:
        """Read ``step`` (latest when None); returns ``(tree, metadata)``."""

    # -- preemption and lifetime -----------------------------------------------------------
    def promote_newest(self) -> int | None:
        """On preemption: make the newest step durable if it is not (returns the step
        queued, or None when there is nothing to promote)."""

    def release_lock(self) -> None:
        """Let the next job open the directory (after a drain)."""

    def close(self) -> None:
        """Flush and release everything."""
