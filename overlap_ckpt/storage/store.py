"""``CheckpointStore``: background persist, PCcheck-style queueing, restore, verify.

Why a background thread with a bounded queue of host copies (PCcheck): the training loop
must never wait for storage. ``save`` only flattens the tree (no copy, no I/O) and queues
it; one worker thread persists steps in order. If steps arrive faster than the disk
drains them, at most ``max_pending_host_copies`` host copies are held (the one being
persisted counts). Beyond that the *oldest not-yet-started* save is dropped (and logged,
and listed in :attr:`CheckpointStore.dropped_steps`) rather than blocking training: a newer
checkpoint makes an older unstarted one redundant, and host memory stays bounded. Pass
``on_backpressure="block"`` to make ``save`` wait for room instead (no step is ever dropped).

Ownership: the arrays handed to ``save`` (numpy buffers, HostArray shards) are referenced,
not copied, until their persist ends or is dropped. The caller must not modify them in the
meantime; that is what makes a "host copy" a copy.

Errors of the background persist never kill training. The failed step is removed (earlier
steps are untouched), the error is kept in :attr:`CheckpointStore.last_error`, and raised
once by the next ``save`` (before queuing anything) or ``wait_until_finished``.

Multi-process seam: the persist protocol (:mod:`.persist`) separates what *every* process
does (write its own shards) from what only the *primary* does (merge, metadata, commit,
retention) by ``coordinator.barrier`` calls (:mod:`.coordination`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Literal

from . import commit, hooks, layout, persist, restore as _restore, retention, verify as _verify, writer
from .coordination import Coordinator, SingleProcess, default_coordinator
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError,
                     StepAlreadyExistsError, StoreClosedError, write_error)
from .location import LocalLocation, Location, open_location, root_context
from .lock import DirectoryLock
from .tree import Leaf, to_leaves

log = logging.getLogger(__name__)

Backpressure = Literal["drop_oldest", "block"]

# ``history`` and ``dropped_steps`` keep this many recent entries: a job that checkpoints
# every few steps for weeks must not grow without bound.
_KEEP_RECORDS = 1000


@dataclasses.dataclass
class _Pending:
    step: int
    leaves: list[Leaf]
    arrays: list[writer.ArrayWrite]
    metadata: dict | None
    nbytes: int
    created_ns: int


@dataclasses.dataclass
class PersistRecord:
    """Timing of one completed persist (for benchmarks and monitoring)."""

    step: int
    nbytes: int
    queued_seconds: float
    persist_seconds: float
    started_perf_s: float = 0.0  # time.perf_counter() when the persist started (timelines)


class CheckpointStore:
    """Persist host copies of a train state in the background; restore and verify them.

    Args:
      directory: local path (``str``/``Path``, or ``file://`` URL) or a TensorStore kvstore URL
        (``memory://``, ``s3://``, ``gs://``) or kvstore JSON spec (e.g. ``{"driver": "s3",
        "bucket": ..., "endpoint": ...}``). Local paths get the full POSIX protocol (tmp dir,
        fsync, atomic rename); kvstores use a commit marker written last.
      max_to_keep: keep at most this many newest complete steps (``None``: keep all).
      keep_every_n_steps: additionally keep forever every step divisible by this.
      max_pending_host_copies: at most this many host copies (persisting + queued) are held.
      on_backpressure: ``"drop_oldest"`` (default, never blocks training) or ``"block"``.
      item_name: the Orbax item name of the tree (Orbax's default is ``"default"``).
      read_only: do not take the directory lock; ``save`` is refused. For evaluators that
        only restore while a trainer owns the directory.
      chunk_bytes: target size of a zarr chunk (the unit of checksum and of partial reads).
      max_inflight_bytes: writes are committed in transactions of about this many bytes (two
        in flight at most); restores and verifies keep at most this many bytes of reads in
        flight.
      ocdbt_target_data_file_size: size at which OCDBT starts a new data file. ``None``
        (default) picks 1/64 of the checkpoint, clamped to [8 MiB, 256 MiB]: several data
        files are written and fsync'd in parallel, which overlaps checksumming with I/O.
      max_request_retries: retries of a failed request to an object store (S3, GCS) before
        the operation fails, with exponential backoff (0.5 s doubling to 8 s): a broken
        endpoint or bucket fails a persist in seconds rather than TensorStore's default of
        32 retries (many minutes); the error surfaces from the next ``save`` or
        ``wait_until_finished``. No effect on local paths.
      copy_threads: how many threads TensorStore may use to encode and checksum chunks
        (``None``: one per core). Lower it to leave cores to training on a small host; the
        writes themselves are I/O and not counted here.
      checksums: write a crc32c with every chunk (default), which TensorStore checks on
        every read: a flipped bit or a truncated copy is then an error at restore and in
        ``verify``, never a wrong state. TensorStore computes it in software, a large share
        of the CPU of a restore (measured on a 242 MiB state, warm page cache, 2 cores: 187
        ms with, 128 ms without; ``benchmarks/results/storage_20m_checksums.md``). ``False``
        for storage that checks its data itself, or where restore time matters more;
        ``verify`` then reports those arrays as written without checksums.
      coordinator: process topology (see :class:`Coordinator`). Default: a
        :class:`overlap_ckpt.storage.coordination.JaxDistributedCoordinator` when ``jax.distributed``
        is initialized with more than one process, else single-process.
    """

    def __init__(self, directory: str | os.PathLike | dict, max_to_keep: int | None = None,
                 keep_every_n_steps: int | None = None, max_pending_host_copies: int = 2, *,
                 on_backpressure: Backpressure = "drop_oldest", item_name: str = layout.ITEM_NAME,
                 read_only: bool = False, chunk_bytes: int = 4 << 20,
                 max_inflight_bytes: int = 1 << 30, ocdbt_target_data_file_size: int | None = None,
                 coordinator: Coordinator | None = None, max_request_retries: int = 8,
                 copy_threads: int | None = None, checksums: bool = True):
        retention.validate(max_to_keep, keep_every_n_steps)
        if not isinstance(max_pending_host_copies, int) or max_pending_host_copies < 1:
            raise ValueError(f"max_pending_host_copies must be an int >= 1, got {max_pending_host_copies!r}")
        if on_backpressure not in ("drop_oldest", "block"):
            raise ValueError(f"on_backpressure must be 'drop_oldest' or 'block', got {on_backpressure!r}")
        layout.validate_array_name(item_name, "item_name")
        self.max_to_keep = max_to_keep
        self.keep_every_n_steps = keep_every_n_steps
        self.max_pending_host_copies = max_pending_host_copies
        self.on_backpressure = on_backpressure
        self.item_name = item_name
        self.read_only = read_only
        self.chunk_bytes = int(chunk_bytes)
        if not isinstance(checksums, bool):
            raise ValueError(f"checksums must be True or False, got {checksums!r}")
        self.checksums = checksums
        self.max_inflight_bytes = int(max_inflight_bytes)
        self.ocdbt_target_data_file_size = ocdbt_target_data_file_size
        self._coord: Coordinator = coordinator or default_coordinator() or SingleProcess()
        self._context = writer.make_context(root_context(), request_retries=max_request_retries,
                                            data_copy_concurrency=copy_threads)
        self.location: Location = open_location(directory, self._context)
        self._lock: DirectoryLock | None = None
        try:
            if not read_only and self._coord.is_primary():
                self._lock = DirectoryLock(self.location)
                self._lock.acquire()
            complete = commit.list_steps(self.location).complete
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - unreachable endpoint, bad bucket or credentials
            if self._lock is not None:
                try:
                    self._lock.release()
                except Exception:  # noqa: BLE001
                    pass
            raise CheckpointError(f"Cannot open checkpoint storage {self.location.url}: {e}. {_open_hint(self.location)}",
                                  path=self.location.url) from e
        self._cv = threading.Condition()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._in_flight: _Pending | None = None
        self._unreported: collections.deque[CheckpointError] = collections.deque()
        self._closing = False
        self._closed = False
        self._worker: threading.Thread | None = None
        self._complete = set(complete)
        #: The most recent background error (reported or not); ``None`` if none happened.
        self.last_error: CheckpointError | None = None
        #: Steps dropped by the ``drop_oldest`` policy, in the order they were dropped.
        self.dropped_steps: list[int] = []
        #: One record per committed step persisted by this store.
        self.history: list[PersistRecord] = []

    # -- public API ------------------------------------------------------------------------
    @property
    def directory(self) -> str:
        return self.location.url

    def save(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """Queue ``tree`` as checkpoint ``step`` and return at once; a background thread persists it.

        Leaves must already be in host memory (HostArray, numpy, CPU jax Arrays); they are
        referenced, not copied, so do not modify them until the step is persisted. A jax
        Array on an accelerator would be copied to the host synchronously here.

        Raises (synchronously) the oldest unreported error of an earlier background persist,
        in which case *this* save was not queued; ``StepAlreadyExistsError`` if ``step`` is
        committed or queued; ``TypeError``/``ValueError`` for leaves that cannot be stored.
        """
        self._check_open()
        self._raise_unreported()
        self.put(step, tree, metadata)

    def put(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """Like :meth:`save`, but never refuses a step because an *earlier* one failed: those
        errors stay for :meth:`take_errors` / :meth:`wait_until_finished`. This is the sink
        contract of the overlap engine (:class:`overlap_ckpt.core.engine.Sink`)."""
        self._check_open()
        if self.read_only:
            raise CheckpointError("This CheckpointStore was opened read_only=True; it cannot save.")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        metadata = _json_copy(metadata, step)
        pending = self._prepare(step, tree, metadata)
        with self._cv:
            busy = {p.step for p in self._queue} | ({self._in_flight.step} if self._in_flight else set())
            if step in self._complete or step in busy:
                raise StepAlreadyExistsError(
                    f"Step {step} is already {'committed' if step in self._complete else 'queued'} "
                    f"in {self.directory}; save each step once (or restore it).", step=step)
            if self.on_backpressure == "block":
                while self._held() >= self.max_pending_host_copies:
                    self._cv.wait()
            # Keep the queue in step order and drop the *lowest* step: saves can arrive out
            # of step order (an explicit save of step 11 queued before the windows of steps
            # 6 and 8 finish replaying), and the newest step is the one worth keeping.
            self._queue.append(pending)
            self._queue = collections.deque(sorted(self._queue, key=lambda p: p.step))
            while self._held() > self.max_pending_host_copies:
                dropped = self._queue.popleft()
                self.dropped_steps.append(dropped.step)
                del self.dropped_steps[:-_KEEP_RECORDS]
                log.warning("Checkpoint step %d dropped before it started: %d host copies are "
                            "already held (max_pending_host_copies=%d) and storage is slower than "
                            "the save interval.", dropped.step, self._held() + 1,
                            self.max_pending_host_copies)
            self._ensure_worker()
            self._cv.notify_all()

    def busy_steps(self) -> list[int]:
        """Steps whose host copy this store still reads (queued or being persisted)."""
        return self.pending_steps()

    def take_errors(self) -> list[CheckpointError]:
        """Background errors not reported yet (each one exactly once), oldest first."""
        if not self._unreported:  # the common case, without the lock (once per training step)
            return []
        with self._cv:
            errors = list(self._unreported)
            self._unreported.clear()
        return errors

    def held_bytes(self) -> int:
        """Bytes of the host copies this store references (queued or being persisted)."""
        with self._cv:
            return sum(p.nbytes for p in self._queue) + (self._in_flight.nbytes if self._in_flight else 0)

    def flush(self) -> None:
        """Block until every queued save is persisted or failed (errors stay for :meth:`take_errors`)."""
        with self._cv:
            while self._queue or self._in_flight is not None:
                if self._worker is None or not self._worker.is_alive():
                    break
                self._cv.wait()

    def wait_until_finished(self) -> None:
        """:meth:`flush`, then raise the oldest unreported error."""
        self.flush()
        self._raise_unreported()

    def latest_step(self) -> int | None:
        """The newest committed step on storage, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (partial steps are never listed)."""
        return commit.list_steps(self.location).complete

    def latest_intact_step(self) -> int:
        """The newest committed step whose metadata reads back; a damaged newer step is
        skipped with a warning (restore it explicitly to see what is wrong with it)."""
        complete = commit.list_steps(self.location).complete
        if not complete:
            self.check_not_foreign()
            raise CheckpointNotFoundError(f"No complete checkpoint in {self.directory}.", path=self.directory)
        for step in reversed(complete):
            try:
                _restore.open_step(self.location, step, layout.step_dir(step), self.item_name)
            except CorruptCheckpointError as e:
                log.warning("checkpoint step %d in %s is damaged (%s); falling back to an earlier step",
                            step, self.directory, e)
                continue
            return step
        raise CorruptCheckpointError(f"every checkpoint in {self.directory} is damaged ({complete}).",
                                     path=self.directory)

    def step_to_restore(self) -> int:
        """The step ``CheckpointManager.restore()`` reads: the newest intact one (a damaged
        newer step is skipped), checked before anything is read."""
        if self.latest_step() is None:
            self.check_not_foreign()
            raise CheckpointNotFoundError(f"no checkpoint in {self.directory}", path=self.directory)
        return self.latest_intact_step()

    def promote_newest(self) -> None:
        """Nothing to promote: every step of this store is already where it stays."""
        return None

    def check_not_foreign(self) -> None:
        """Raise when the directory holds no Orbax-layout step but looks like another
        format's checkpoints (Flax ``checkpoint_N`` files...): starting from scratch there
        would silently ignore the user's checkpoints."""
        foreign = commit.foreign_checkpoints(self.location)
        if foreign:
            raise CheckpointNotFoundError(
                f"{self.directory} holds no checkpoint in Orbax's CheckpointManager layout, but "
                f"{len(foreign)} entries that look like checkpoints of another format "
                f"({', '.join(foreign[:3])}). overlap_ckpt reads <step>/<item> directories written "
                "by orbax.checkpoint.CheckpointManager or by itself; restore the old checkpoint "
                "with the library that wrote it and save it here, or use another directory.",
                path=self.directory)

    def incomplete_steps(self) -> list[int]:
        """Partial steps left on storage by a crash or failure (not the one being written now)."""
        busy = self._in_flight.step if self._in_flight else None
        return [s for s in commit.list_steps(self.location).incomplete if s != busy]

    def pending_steps(self) -> list[int]:
        """Steps queued or being persisted by this store."""
        with self._cv:
            return ([self._in_flight.step] if self._in_flight else []) + [p.step for p in self._queue]

    def restore(self, step: int | None = None, target: Any = None, *,
                allow_cast: bool = False) -> tuple[Any, dict]:
        """Read checkpoint ``step`` (latest when ``None``); returns ``(tree, metadata)``.

        ``target=None`` returns the saved tree as nested dicts/lists of numpy arrays. A target
        pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding``) or ``jax.Array`` leaves returns
        ``jax.Array`` leaves with the target's structure and sharding, reading only what this
        process's devices need; numpy leaves in the target come back as numpy. Different dtypes
        raise :class:`TargetMismatchError` unless ``allow_cast=True``.
        """
        self._check_open()
        step = self._resolve_step(step)
        view = _restore.open_step(self.location, step, layout.step_dir(step), self.item_name)
        if target is None:
            self._check_numpy_restore(view, step)
            tree = _restore.restore_numpy(view, self._context, self.max_inflight_bytes)
        else:
            tree = _restore.restore_target(view, target, self._context,
                                           self.max_inflight_bytes, allow_cast)
        return tree, view.custom_metadata

    def verify(self, step: int | None = None) -> _verify.VerifyReport:
        """Read every chunk of ``step`` (all committed steps when ``None``) and check checksums
        and completeness. Never raises for damaged data: see :meth:`VerifyReport.raise_if_failed`."""
        self._check_open()
        listing = commit.list_steps(self.location)
        steps = listing.complete if step is None else [step]
        checks = {}
        for s in steps:
            if s in listing.complete:
                checks[s] = _verify.verify_step(self.location, s, layout.step_dir(s), self.item_name,
                                                self._context, self.max_inflight_bytes)
            else:
                checks[s] = _verify.StepCheck(s)
                try:
                    self._resolve_step(s)
                except CheckpointError as e:
                    checks[s].fail(e)
        return _verify.VerifyReport(checks, listing.incomplete)

    def release_lock(self) -> None:
        """Give up the directory lock now (a process about to exit, so the next job may start)."""
        if self._lock is not None:
            self._lock.release()

    def close(self) -> None:
        """Finish queued saves, stop the worker and release the directory lock.

        Raises the first unreported background error, after the lock is released."""
        if self._closed:
            return
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join()
        if self._lock is not None:
            self._lock.release()
        self._closed = True
        self._raise_unreported()

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except CheckpointError:
            log.exception("Error while closing the checkpoint store during another exception")

    def __repr__(self) -> str:
        return (f"CheckpointStore({self.directory!r}, max_to_keep={self.max_to_keep}, "
                f"pending={self.pending_steps()})")

    @property
    def context(self):
        """The TensorStore context of this store's reads and writes (shared I/O limits)."""
        return self._context

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"CheckpointStore({self.directory!r}) is closed.")

    def _held(self) -> int:
        return len(self._queue) + (self._in_flight is not None)

    def _raise_unreported(self) -> None:
        with self._cv:
            err = self._unreported.popleft() if self._unreported else None
        if err is not None:
            raise err

    def _check_numpy_restore(self, view, step: int) -> None:
        """In a multi-process job, ``target=None`` is only meaningful when the job has as many
        processes as the one that saved (each process then gets the whole arrays as numpy);
        across a change of process count the caller must say how to shard."""
        if self._coord.process_count <= 1:
            return
        raw = self.location.read_bytes(f"{view.item_rel}/{layout.MANIFEST}", layout.MAX_METADATA_BYTES)
        try:
            saved = json.loads(raw)["process_count"] if raw is not None else None
        except (ValueError, KeyError, TypeError):
            saved = None
        if saved != self._coord.process_count:
            who = f"{saved} process(es)" if saved is not None else "an unknown number of processes"
            raise CheckpointError(
                f"Step {step} in {self.directory} was written by {who}; this job has "
                f"{self._coord.process_count}. Restoring across a change of process count needs "
                "target shardings: call restore(step, target=...) with jax.ShapeDtypeStruct "
                "(or jax.Array) leaves whose .sharding spans this job's devices, so that each "
                "process reads only the shards its devices need.", step=step, path=self.directory)

    def _resolve_step(self, step: int | None) -> int:
        listing = commit.list_steps(self.location)
        if step is None:
            if not listing.complete:
                hint = (f" (partial steps {listing.incomplete} exist: they never committed)"
                        if listing.incomplete else "")
                raise CheckpointNotFoundError(f"No complete checkpoint in {self.directory}{hint}.",
                                              path=self.directory)
            return listing.complete[-1]
        if step in listing.complete:
            return step
        if step in listing.incomplete or step in self.pending_steps():
            raise IncompleteCheckpointError(
                f"Step {step} in {self.directory} is partial: it was never committed (a crash, a "
                f"failed write, or a save still in progress). Complete steps: {listing.complete}. "
                "Call wait_until_finished() first if this store is saving it.", step=step,
                path=self.directory)
        raise CheckpointNotFoundError(
            f"Step {step} does not exist in {self.directory}; complete steps: {listing.complete}.",
            step=step, path=self.directory)

    def _prepare(self, step: int, tree: Any, metadata: dict | None) -> _Pending:
        leaves = to_leaves(tree)
        arrays = writer.prepare_arrays(leaves, self.chunk_bytes, checksums=self.checksums)
        nbytes = sum(a.host.nbytes for a in arrays)
        return _Pending(step, leaves, arrays, metadata, nbytes, time.time_ns())

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="overlap-ckpt-persist", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                pending = self._in_flight = self._queue.popleft()
            try:
                self._persist_or_report(pending)
            finally:
                pending = None  # hold no host copy past its persist (host memory budget)
                with self._cv:
                    self._in_flight = None
                    self._cv.notify_all()

    def _persist_or_report(self, p: _Pending) -> None:
        started_ns, start = time.time_ns(), time.perf_counter()
        try:
            self._persist(p)
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            removed = True
            if self._coord.is_primary():
                try:
                    removed = commit.delete_failed(self.location, p.step)
                except Exception:  # noqa: BLE001
                    removed = False
                    log.exception("Removing the partial step %d failed; the next save retries.", p.step)
            err = write_error(e, step=p.step, path=self.location.describe(layout.step_dir(p.step)),
                              partial_removed=removed)
            log.error("%s", err)
            self._report(err)
            return
        del self.history[:-(_KEEP_RECORDS - 1)]
        self.history.append(PersistRecord(p.step, p.nbytes, (started_ns - p.created_ns) / 1e9,
                                          time.perf_counter() - start, start))
        if self._coord.is_primary():
            try:
                self._after_commit(p.step)
            except Exception as e:  # noqa: BLE001
                err = CheckpointError(f"Step {p.step} was committed, but deleting old or partial "
                                      f"steps failed: {e}. They will be retried after the next "
                                      "save.", step=p.step, path=self.directory)
                err.__cause__ = e
                log.error("%s", err)
                self._report(err)

    def _report(self, err: CheckpointError) -> None:
        with self._cv:
            self.last_error = err
            self._unreported.append(err)

    def _persist(self, p: _Pending) -> None:
        persist.persist_step(
            self.location, p.step, self.item_name, p.leaves, p.arrays,
            layout.step_metadata(p.metadata, p.created_ns, self.item_name), self._context,
            coordinator=self._coord, batch_bytes=self.max_inflight_bytes,
            data_file_size=self.ocdbt_target_data_file_size, on_committed=self._mark_complete)

    def _mark_complete(self, step: int) -> None:
        with self._cv:
            self._complete.add(step)

    def _after_commit(self, step: int) -> None:
        """Retention and cleanup, strictly after a successful commit."""
        listing = commit.list_steps(self.location)
        doomed = retention.steps_to_delete(listing.complete, max_to_keep=self.max_to_keep,
                                           keep_every_n_steps=self.keep_every_n_steps,
                                           protected={step})
        for s in doomed:
            commit.delete_step(self.location, s)
            with self._cv:
                self._complete.discard(s)
        for s in listing.incomplete:
            commit.delete_incomplete(self.location, s)
        hooks.fire("retention", step=step, deleted=doomed)


def _json_copy(metadata: dict | None, step: int) -> dict | None:
    """A deep, JSON-validated copy: later mutation by the caller cannot change the checkpoint."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict or None, got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(metadata, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata of step {step} must be JSON-serializable: {e}") from e


def _open_hint(location: Location) -> str:
    """What to check when a location cannot be opened: a local directory's permissions and
    free space, or an object store's bucket, endpoint and credentials."""
    if isinstance(location, LocalLocation):
        return ("Check that the directory exists or can be created, that this user may write "
                "there (or pass save_interval_steps=None to only restore), and the free space.")
    return ("Check the bucket/path, the endpoint and the credentials (for S3: AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_REGION or an instance role).")
