"""A fast local tier beside the durable one: checkpoints every few steps that survive a
crashed process.

Why: a failure costs the steps since the last checkpoint, and what limits the interval is
storage (a 1B-parameter Adam state is ~16 GB), not the device side of a checkpoint, which
overlapped windows make nearly free. Writing the same consistent host copy to node-local
memory (tmpfs) every few steps, and to durable storage only every ``save_interval_steps``,
bounds the loss of a crashed process to a few steps while the durable tier still covers
the loss of every host.

:class:`~overlap_ckpt.tiers.config.LocalTier` is the user's configuration; :class:`TieredStore`
implements the store contract (:class:`~overlap_ckpt.storage.protocol.Store`) over two
``CheckpointStore`` objects. One capture serves both tiers: each host copy is handed by
reference to the local store and, on durable steps, to the durable store too; the copy is
released once both have written it.

Multi-process jobs: each process keeps its own shards in its own local directory
(``<path>/process_<i>``, written with no barriers: node-local storage is not shared) and,
with ``replicas=R``, the local steps of R peers (:mod:`overlap_ckpt.tiers.peers`), so a local
step is complete where every process's shards are in some process's local tier.
:meth:`TieredStore.newest_step` agrees through ``jax.distributed``'s key-value store on the
newest step complete everywhere, or else the newest durable step; a process whose own copy
is gone gets it from the peer holding its replica.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from typing import Any, NamedTuple

from ..errors import CheckpointError
from .config import LocalTier
from .peers import TIER_KEY, PeerReplicas, intact_steps, writer_tag

log = logging.getLogger(__name__)
_instances = itertools.count()  # key-value namespaces: stores are built in the same order everywhere
_AGREE_TIMEOUT_MS = 300_000


class TieredStore:
    """The local tier and the durable tier behind one storage interface.

    Args:
      durable: the durable :class:`~overlap_ckpt.storage.CheckpointStore`.
      tier: the :class:`LocalTier` configuration.
      interval: durable checkpoint interval (``save_interval_steps``); ``None`` for a
        manager that only restores (the local store is then opened read-only too).
    """

    def __init__(self, durable: Any, tier: LocalTier, interval: int | None):
        from ..storage.coordination import distributed_client

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
        tier.check_processes(self.process_count)
        self._namespace = f"overlap_ckpt/tiers/{next(_instances)}"
        self._agreements = itertools.count()
        self._local_dir = tier.directory(durable.directory, self.process_index, self.process_count)
        self._tag = writer_tag(self.process_index, self.process_count)
        self.local = self._open_local()
        self.peers = None if not tier.replicas else PeerReplicas(
            self._client, f"{self._namespace}/peers", process_index=self.process_index,
            process_count=self.process_count, replicas=tier.replicas, own_dir=self._local_dir,
            own_steps=self._committed_local, item_name=durable.item_name, max_to_keep=tier.max_to_keep)
        if self.peers is not None and not durable.read_only:
            self.peers.start()
        self._layouts: dict[int, tuple[Any, list[_PutLeaf]]] = {}  # local step -> what this process put
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
        tagged = {**(metadata or {}), TIER_KEY: self._tag}
        if self.process_count > 1:
            from .restore import LAYOUT_KEY, layouts_of

            self._layouts[step] = _blocks_of(tree)
            tagged[LAYOUT_KEY] = layouts_of([(leaf.name, leaf.sharding) for leaf in self._layouts[step][1]])
            for old in sorted(self._layouts)[:-(self.tier.max_to_keep + 2)]:  # + steps still queued
                del self._layouts[old]
        first_error = None
        for store, meta, wanted in ((self.local, tagged, True), (self.durable, metadata, durable)):
            if not wanted:
                continue
            try:
                store.put(step, tree, meta)
            except Exception as e:  # noqa: BLE001 - the other tier still gets its copy
                first_error = first_error or e
        if self.peers is not None:
            self.peers.notify()
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
        peers = self.peers.take_errors() if self.peers is not None else []
        return self.local.take_errors() + self.durable.take_errors() + peers

    def flush(self) -> None:
        """Wait for both tiers' writes and for the newest local step's replicas."""
        self.local.flush()
        self.durable.flush()
        if self.peers is not None:
            self.peers.flush()

    def _committed_local(self) -> tuple[Any, list[int]]:
        """The replication sender's view: local writes done, then the intact local steps."""
        self.local.flush()
        return self.local.location, self.local_steps()

    # -- queries and restore -----------------------------------------------------------------
    def local_steps(self) -> list[int]:
        """Local steps this process can restore: committed, metadata intact, written by this
        process of a job of this size (a torn write is never committed, so never listed)."""
        return intact_steps(self.local.location, self.local.all_steps(), self.local.item_name, self._tag)

    def all_steps(self) -> list[int]:
        return sorted(set(self.local.all_steps()) | set(self.durable.all_steps()))

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def latest_intact_step(self) -> int:
        return self.newest_step()

    def newest_step(self, skip: frozenset[int] = frozenset()) -> int:
        """The newest step every process can restore: from the local tiers when every
        process's shards of it are in some process's local tier (its own or a peer's
        replica), else the newest intact durable step; local steps in ``skip`` do not count.
        Collective in a multi-process job (every process must call it, in the same order)."""
        from ..storage import CheckpointNotFoundError, CorruptCheckpointError

        try:
            durable = self.durable.latest_intact_step()
        except (CheckpointNotFoundError, CorruptCheckpointError):
            durable = None
        views = self._exchange({**self._local_view(), "durable": durable})
        common = set.intersection(*_available(views).values()) - set(skip)
        durables = [v["durable"] for v in views]
        durable = None if None in durables else min(durables)
        best = max([s for s in (max(common, default=None), durable) if s is not None], default=None)
        if best is None:
            raise CheckpointNotFoundError(
                f"No complete checkpoint in the local tier ({self.local.directory}) or in "
                f"{self.durable.directory}.", path=self.durable.directory)
        return best

    def step_to_restore(self) -> None:
        """None: the processes agree on the step within :meth:`restore`, skipping local steps
        one of them cannot read."""
        return None

    def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> tuple[Any, dict]:
        """Read ``step`` from the local tiers when every process's shards of it are there,
        else from the durable tier. Collective in a multi-process job: a process whose own
        copy is gone first gets it from the peer holding its replica, then each process
        reads the blocks it wrote and jax's collectives place them on the target's layout
        (:mod:`overlap_ckpt.tiers.restore`); that needs ``target``.

        ``step=None``: the newest step every process can restore (:meth:`newest_step`). A
        local step that some process cannot read in full (a torn or wiped file, a step
        written on other devices) is then skipped, with a warning naming it and the
        process, for the next newest, down to the durable tier: a restart is never blocked
        by the local tier. The processes agree on every read before any collective, so a
        process that failed never leaves the others waiting in one.
        """
        if step is not None:
            return self._restore_step(int(step), target, **kwargs)
        skipped: set[int] = set()
        while True:
            step = self.newest_step(frozenset(skipped))
            try:
                return self._restore_step(step, target, **kwargs)
            except LocalStepUnreadable as e:
                log.warning("%s; restoring the next newest step instead", e)
                skipped.add(step)

    def _restore_step(self, step: int, target: Any, **kwargs: Any) -> tuple[Any, dict]:
        self._drop_local_after(step)
        agreement = next(self._agreements)
        sources = _sources(self._exchange(self._local_view()), step)
        if None in sources.values() or (target is None and self.process_count > 1):
            return self.durable.restore(step, target, **kwargs)
        from ..storage import layout, restore
        from .restore import LAYOUT_KEY, owned_target, spread, written_shardings

        tree = meta = written = None
        error = None
        try:
            if any(q != p for p, q in sources.items()):
                self.peers.hand_over(step, sources, self.local.location, agreement)
                self.local.close()
                self.local = self._open_local()  # it lists the step installed behind its back
            if self.process_count == 1:
                tree, meta = self.local.restore(step, target, **kwargs)
            else:
                view = restore.open_step(self.local.location, step, layout.step_dir(step), self.local.item_name)
                written = written_shardings((view.custom_metadata or {}).get(LAYOUT_KEY))
                tree, meta = self.local.restore(step, owned_target(target, written), **kwargs)
        except (CheckpointError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        failed = {p: v for p, v in enumerate(self._exchange(error)) if v}
        if failed:
            raise LocalStepUnreadable(step, failed)
        if self.process_count > 1:
            tree = spread(tree, target, written)
        return tree, {k: v for k, v in (meta or {}).items() if k not in (TIER_KEY, LAYOUT_KEY)}

    def _local_view(self) -> dict[str, Any]:
        """What this process can give a local restore: its own steps and the replicas it holds."""
        held = self.peers.held_steps() if self.peers is not None else {}
        return {"local": self.local_steps(), "held": {str(j): steps for j, steps in held.items()}}

    def _drop_local_after(self, step: int) -> None:
        """Delete local steps newer than the one the job resumes from: training goes on from
        ``step``, and a step it writes again must not meet (or be mixed, across processes,
        with) the one of the abandoned run. The store is reopened so that it forgets them."""
        from ..storage import commit

        if self.read_only:
            return
        if self.peers is not None:
            self.peers.drop_after(step)
        newer = [s for s in self.local.all_steps() if s > step]
        if not newer:
            return
        self.local.close()
        for s in newer:
            commit.delete_step(self.local.location, s)
        self.local = self._open_local()

    def _open_local(self):
        from ..storage import CheckpointStore, SingleProcess

        durable = self.durable
        # No barriers: each process's local tier is its own (node-local) checkpoint directory.
        # Back-pressure as the durable store's: "block" makes both tiers wait, never drop.
        return CheckpointStore(
            self._local_dir, max_to_keep=self.tier.max_to_keep, read_only=durable.read_only,
            coordinator=SingleProcess(), item_name=durable.item_name, chunk_bytes=durable.chunk_bytes,
            checksums=durable.checksums,
            on_backpressure=durable.on_backpressure, max_pending_host_copies=durable.max_pending_host_copies)

    def check_not_foreign(self) -> None:
        self.durable.check_not_foreign()

    # -- preemption and lifetime -----------------------------------------------------------
    def promote_newest(self) -> int | None:
        """Copy the newest local step to the durable tier if it is newer than every durable
        step (on preemption); returns the step queued, or None. Collective with N processes:
        they agree on the newest step each holds itself, and each writes the blocks it put
        there (read back from its local tier) to the durable step, which the durable store
        commits once every process wrote its part."""
        if self.read_only:
            return None
        promotable = self.local_steps()
        if self.process_count > 1:  # a step restored from, not written by, this run: no layout
            promotable = [s for s in promotable if s in self._layouts]
        durable = self.durable.all_steps() + self.durable.pending_steps()
        views = self._exchange({"local": promotable, "durable": max(durable, default=None)})
        step = max(set.intersection(*(set(v["local"]) for v in views)), default=None)
        newest_durable = max((v["durable"] for v in views if v["durable"] is not None), default=None)
        if step is None or (newest_durable is not None and newest_durable >= step):
            return None
        tree, meta = self.restore(step) if self.process_count == 1 else self._read_own_blocks(step)
        self.durable.put(step, tree, meta)
        return step

    def _read_own_blocks(self, step: int) -> tuple[Any, dict]:
        """The tree this process put as local step ``step``, its blocks read back from the
        local tier (only this process's, as the capture handed them over)."""
        from ..hostarray import HostArray, HostShard, index_from_key
        from ..storage import layout, restore

        treedef, leaves = self._layouts[step]
        view = restore.open_step(self.local.location, step, layout.step_dir(step), self.local.item_name)
        stores = restore.open_arrays(view, [leaf.name for leaf in leaves if leaf.kind != "empty"],
                                     self.local.context)
        reads = [[(index_from_key(k), stores[leaf.name][index_from_key(k)].read()) for k in leaf.blocks]
                 for leaf in leaves]  # every read in flight at once
        values = []
        for leaf, blocks in zip(leaves, reads):
            if leaf.kind == "empty":
                values.append(leaf.node)
                continue
            host = HostArray(leaf.shape, leaf.dtype, [HostShard(index, read.result()) for index, read in blocks])
            if leaf.kind == "host":
                values.append(host)
            else:
                values.append(host.to_numpy().item() if leaf.kind == "scalar" else host.to_numpy())
        meta = {k: v for k, v in (view.custom_metadata or {}).items() if k != TIER_KEY}
        return treedef.unflatten(values), meta

    def release_lock(self) -> None:
        self.local.release_lock()
        self.durable.release_lock()

    def close(self) -> None:
        try:
            if self.peers is not None:
                self.peers.close()
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


class LocalStepUnreadable(CheckpointError):
    """A local-tier step that some process could not read in full (``failed``: by process,
    why). Raised by a restore of that step by number; a restore of the newest step skips it."""

    def __init__(self, step: int, failed: dict[int, str]):
        self.failed = failed
        why = "; ".join(f"process {p}: {e}" for p, e in sorted(failed.items()))
        super().__init__(f"local-tier step {step} cannot be restored ({why})", step=step)


def _available(views: list[dict]) -> dict[int, set[int]]:
    """Per process, the local steps whose shards of that process are in some process's
    local tier (its own, or a replica a peer holds)."""
    available = {p: set(v["local"]) for p, v in enumerate(views)}
    for view in views:
        for source, steps in view["held"].items():
            available[int(source)] |= set(steps)
    return available


def _sources(views: list[dict], step: int) -> dict[int, int | None]:
    """Per process, where its shards of local step ``step`` are read from: itself when it
    has its own copy, else the first peer holding its replica, else None (durable tier)."""
    return {p: p if step in v["local"] else
            min((q for q, w in enumerate(views) if step in w["held"].get(str(p), [])), default=None)
            for p, v in enumerate(views)}


class _PutLeaf(NamedTuple):
    """One leaf of a local step as this process put it: enough to read it back."""

    kind: str  # "host" (a HostArray), "numpy", "scalar" (a Python number), "empty" (an empty node)
    name: str = ""  # the saved array's name
    shape: tuple[int, ...] = ()
    dtype: Any = None
    blocks: tuple = ()  # index keys of the blocks this process wrote
    node: Any = None  # the empty node itself
    sharding: Any = None  # the jax sharding whose replica-0 blocks they are, when known


def _blocks_of(tree: Any) -> tuple[Any, list[_PutLeaf]]:
    """What a promotion needs to read a local step back as the tree that was put: its
    structure and each leaf's blocks (no data: the local tier holds that)."""
    import jax

    from ..hostarray import HostArray, index_key
    from ..storage.tree import as_host_array, is_empty_node
    from .restore import leaf_name

    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty_node)
    leaves = []
    for path, leaf in flat:
        if is_empty_node(leaf):
            leaves.append(_PutLeaf("empty", node=leaf))
            continue
        host = as_host_array(leaf)
        kind = "host" if isinstance(leaf, HostArray) else \
            "scalar" if isinstance(leaf, (bool, int, float, complex)) else "numpy"
        leaves.append(_PutLeaf(kind, leaf_name(path), host.shape, host.dtype,
                               tuple(index_key(index) for index in host.layout_indices), sharding=host.sharding))
    return treedef, leaves


def _tree_nbytes(tree: Any) -> int:
    import jax

    return sum(int(getattr(leaf, "nbytes", 0)) for leaf in jax.tree.leaves(tree))


__all__ = ["LocalTier", "TieredStore"]
