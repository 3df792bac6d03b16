"""A fast local tier beside the durable one: checkpoints every few steps that survive a
crashed process.

Why: a failure costs the steps since the last checkpoint, and what limits the interval is
storage (a 1B-parameter Adam state is ~16 GB), not the device side of a checkpoint, which
overlapped windows make nearly free. Writing the same consistent host copy to node-local
memory (tmpfs) every few steps, and to durable storage only every ``save_interval_steps``,
bounds the loss of a crashed process to a few steps while the durable tier still covers
the loss of every host.

:class:`LocalTier` is the user's configuration; :class:`TieredStore` presents the storage
interface the manager and the engine use (the engine's sink contract, the restore and
query methods of :class:`~overlap_ckpt.storage.CheckpointStore`) over two
``CheckpointStore`` objects. One capture serves both tiers: each host copy is handed by
reference to the local store and, on durable steps, to the durable store too; the copy is
released once both have written it.

Multi-process jobs: each process keeps its own shards in its own local directory
(``<path>/process_<i>``, written with no barriers: node-local storage is not shared), so a
local step is complete only where every process committed it. :meth:`TieredStore.newest_step`
agrees through ``jax.distributed``'s key-value store on the newest step complete on every
process, or else the newest durable step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import tempfile
import threading
from typing import Any

from .errors import ConfigError

log = logging.getLogger(__name__)

_TIER_KEY = "local_tier"  # custom step metadata: which process of how many wrote the step
_instances = itertools.count()  # key-value namespaces: stores are built in the same order everywhere
_AGREE_TIMEOUT_MS = 300_000


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """Configuration of the local tier of a :class:`~overlap_ckpt.CheckpointManager`.

    Args:
      path: node-local directory (tmpfs for memory speed). ``None``: a directory under
        ``/dev/shm`` named after the durable directory, so a restarted job finds it.
      every: write the consistent host copy here every ``every`` steps; the manager's
        ``save_interval_steps`` must be a multiple of it (the durable steps are a subset).
      max_to_keep: local steps kept (each holds a full copy of this process's shards in
        node memory when ``path`` is on tmpfs).
    """

    path: str | os.PathLike | None = None
    every: int = 10
    max_to_keep: int = 2

    def __post_init__(self) -> None:
        for name in ("every", "max_to_keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"LocalTier.{name} must be an int >= 1, got {value!r}")
        if self.path is not None and (not isinstance(self.path, (str, os.PathLike))
                                      or "://" in os.fspath(self.path)):
            raise ConfigError(f"LocalTier.path must be a node-local directory path, got {self.path!r}; "
                              "object stores belong in the durable directory")

    def check_interval(self, save_interval_steps: int | None) -> None:
        if save_interval_steps is not None and save_interval_steps % self.every:
            raise ConfigError(f"save_interval_steps={save_interval_steps} must be a multiple of "
                              f"LocalTier.every={self.every}: every durable checkpoint is also a local one")

    def directory(self, durable_url: str, process_index: int, process_count: int) -> str:
        """This process's local directory."""
        if self.path is not None:
            root = os.fspath(self.path)
        else:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            root = os.path.join(base, "overlap_ckpt", hashlib.sha1(durable_url.encode()).hexdigest()[:16])
        return root if process_count <= 1 else os.path.join(root, f"process_{process_index}")


class TieredStore:
    """The local tier and the durable tier behind one storage interface.

    Args:
      durable: the durable :class:`~overlap_ckpt.storage.CheckpointStore`.
      tier: the :class:`LocalTier` configuration.
      interval: durable checkpoint interval (``save_interval_steps``); ``None`` for a
        manager that only restores (the local store is then opened read-only too).
    """

    def __init__(self, durable: Any, tier: LocalTier, interval: int | None):
        from .storage.coordination import distributed_client

        tier.check_interval(interval)
        self.durable = durable
        self.tier = tier
        self.interval = interval
        self.every = tier.every
        self._client = distributed_client()
        if self._client is not None:
            import jax
            self.process_index, self.process_count = jax.process_index(), jax.process_count()
        else:
            self.process_index, self.process_count = 0, 1
        self._namespace = f"overlap_ckpt/tiers/{next(_instances)}"
        self._agreements = itertools.count()
        self._local_dir = tier.directory(durable.directory, self.process_index, self.process_count)
        self.local = self._open_local()
        self._nbytes: dict[int, int] = {}  # step -> bytes of its host copy (one copy, both tiers)
        self._entering: set[int] = set()  # steps being handed to the tiers (not pending yet)
        self._lock = threading.Lock()  # the engine thread puts, the training thread asks held_bytes

    # -- the engine's sink ------------------------------------------------------------------
    def put(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """Queue the host copy of ``step`` to the local tier and, on durable steps, to the
        durable tier as well (the same arrays, by reference)."""
        self._put(step, tree, metadata, durable=self.interval is not None and step % self.interval == 0)

    def save(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """An explicit save (``mngr.save``): both tiers, whatever the interval."""
        self._put(step, tree, metadata, durable=True)

    def _put(self, step: int, tree: Any, metadata: dict | None, *, durable: bool) -> None:
        with self._lock:
            self._nbytes[step] = _tree_nbytes(tree)
            self._entering.add(step)
        try:
            self._put_tiers(step, tree, metadata, durable)
        finally:
            with self._lock:
                self._entering.discard(step)

    def _put_tiers(self, step: int, tree: Any, metadata: dict | None, durable: bool) -> None:
        tagged = {**(metadata or {}), _TIER_KEY: {"process": self.process_index,
                                                  "processes": self.process_count}}
        first_error = None
        for store, meta, wanted in ((self.local, tagged, True), (self.durable, metadata, durable)):
            if not wanted:
                continue
            try:
                store.put(step, tree, meta)
            except Exception as e:  # noqa: BLE001 - the other tier still gets its copy
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def busy_steps(self) -> list[int]:
        return self.pending_steps()

    def pending_steps(self) -> list[int]:
        return sorted(set(self.local.pending_steps()) | set(self.durable.pending_steps()))

    def held_bytes(self) -> int:
        """Bytes of host copies still referenced; a copy queued in both tiers counts once."""
        pending = set(self.pending_steps())
        with self._lock:
            for step in [s for s in self._nbytes if s not in pending and s not in self._entering]:
                del self._nbytes[step]
            return sum(self._nbytes.values())

    @property
    def dropped_steps(self) -> list[int]:
        return sorted(set(self.local.dropped_steps) | set(self.durable.dropped_steps))

    @property
    def on_backpressure(self) -> str:
        return self.durable.on_backpressure

    @property
    def directory(self) -> str:
        return self.durable.directory

    @property
    def read_only(self) -> bool:
        return self.durable.read_only

    def take_errors(self) -> list:
        return self.local.take_errors() + self.durable.take_errors()

    def flush(self) -> None:
        self.local.flush()
        self.durable.flush()

    # -- queries and restore -----------------------------------------------------------------
    def local_steps(self) -> list[int]:
        """Local steps this process can restore: committed, metadata intact, written by this
        process of a job of this size (a torn write is never committed, so never listed)."""
        from .storage import CheckpointError, layout, restore

        steps = []
        for step in self.local.all_steps():
            try:
                meta = restore.open_step(self.local.location, step, layout.step_dir(step),
                                         self.local.item_name).custom_metadata
            except CheckpointError as e:
                log.warning("local-tier step %d in %s is damaged (%s); not used", step,
                            self.local.directory, e)
                continue
            if (meta or {}).get(_TIER_KEY) == {"process": self.process_index, "processes": self.process_count}:
                steps.append(step)
        return steps

    def all_steps(self) -> list[int]:
        return sorted(set(self.local.all_steps()) | set(self.durable.all_steps()))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def latest_intact_step(self) -> int:
        return self.newest_step()

    def newest_step(self) -> int:
        """The newest step every process can restore: from the local tiers when every
        process holds it, else the newest intact durable step. Collective in a
        multi-process job (every process must call it, in the same order)."""
        from .storage import CheckpointNotFoundError, CorruptCheckpointError

        try:
            durable = self.durable.latest_intact_step()
        except (CheckpointNotFoundError, CorruptCheckpointError):
            durable = None
        views = self._exchange({"local": self.local_steps(), "durable": durable})
        common = set.intersection(*(set(v["local"]) for v in views))
        durables = [v["durable"] for v in views]
        durable = None if None in durables else min(durables)
        best = max([s for s in (max(common, default=None), durable) if s is not None], default=None)
        if best is None:
            raise CheckpointNotFoundError(
                f"No complete checkpoint in the local tier ({self.local.directory}) or in "
                f"{self.durable.directory}.", path=self.durable.directory)
        return best

    def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> tuple[Any, dict]:
        """Read ``step`` (:meth:`newest_step` when None) from the local tier when every
        process holds it there, else from the durable tier. Collective in a multi-process
        job: each process reads the blocks it owned and jax's collectives place the
        replicated ones (:mod:`overlap_ckpt.tier_restore`); that needs ``target``."""
        step = self.newest_step() if step is None else int(step)
        self._drop_local_after(step)
        everywhere = step in set.intersection(*(set(v) for v in self._exchange(self.local_steps())))
        if not everywhere or (target is None and self.process_count > 1):
            return self.durable.restore(step, target, **kwargs)
        if self.process_count == 1:
            tree, meta = self.local.restore(step, target, **kwargs)
        else:
            from .tier_restore import owned_target, spread
            tree, meta = self.local.restore(step, owned_target(target), **kwargs)
            tree = spread(tree, target)
        return tree, {k: v for k, v in (meta or {}).items() if k != _TIER_KEY}

    def _drop_local_after(self, step: int) -> None:
        """Delete local steps newer than the one the job resumes from: training goes on from
        ``step``, and a step it writes again must not meet (or be mixed, across processes,
        with) the one of the abandoned run. The store is reopened so that it forgets them."""
        from .storage import commit

        newer = [s for s in self.local.all_steps() if s > step]
        if self.read_only or not newer:
            return
        self.local.close()
        for s in newer:
            commit.delete_step(self.local.location, s)
        self.local = self._open_local()

    def _open_local(self):
        from .storage import CheckpointStore, SingleProcess

        durable = self.durable
        # No barriers: each process's local tier is its own (node-local) checkpoint directory.
        # Back-pressure as the durable store's: "block" makes both tiers wait, never drop.
        return CheckpointStore(
            self._local_dir, max_to_keep=self.tier.max_to_keep, read_only=durable.read_only,
            coordinator=SingleProcess(), item_name=durable.item_name, chunk_bytes=durable.chunk_bytes,
            on_backpressure=durable.on_backpressure, max_pending_host_copies=durable.max_pending_host_copies)

    def check_not_foreign(self) -> None:
        self.durable.check_not_foreign()

    # -- preemption and lifetime -----------------------------------------------------------
    def promote_newest(self) -> int | None:
        """Copy the newest local step to the durable tier if it is newer than every durable
        step (on preemption); returns the step queued, or None. Single process only: in a
        multi-process job each local tier holds one process's shards, and rebuilding the
        durable step from them needs every process's target shardings."""
        if self.process_count > 1 or self.read_only:
            return None
        local = self.local_steps()
        durable = self.durable.all_steps() + self.durable.pending_steps()
        if not local or (durable and max(durable) >= local[-1]):
            return None
        tree, meta = self.restore(local[-1])
        self.durable.put(local[-1], tree, meta)
        return local[-1]

    def release_lock(self) -> None:
        self.local.release_lock()
        self.durable.release_lock()

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self.durable.close()

    def __repr__(self) -> str:
        return f"TieredStore(local={self.local.directory!r} every {self.every}, durable={self.directory!r})"

    def _exchange(self, mine: Any) -> list[Any]:
        """Every process's ``mine``, by process index (through jax.distributed's key-value
        store; just ``[mine]`` in a single-process job)."""
        if self.process_count == 1:
            return [mine]
        from .storage import CheckpointError

        prefix = f"{self._namespace}/{next(self._agreements)}/"
        self._client.key_value_set(f"{prefix}{self.process_index}", json.dumps(mine), allow_overwrite=True)
        views = []
        for p in range(self.process_count):
            try:
                views.append(mine if p == self.process_index else
                             json.loads(self._client.blocking_key_value_get(f"{prefix}{p}", _AGREE_TIMEOUT_MS)))
            except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED from the coordination service
                raise CheckpointError(
                    f"process {p} did not report its local-tier steps within {_AGREE_TIMEOUT_MS // 1000} s: "
                    "every process must restore (or ask for the newest step) at the same point") from e
        return views


def _tree_nbytes(tree: Any) -> int:
    import jax

    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(tree))


__all__ = ["LocalTier", "TieredStore"]
