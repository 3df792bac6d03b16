"""Who the job's processes are, and the barriers of a persist between them.

:class:`Coordinator` is the seam the persist protocol (:mod:`.persist`) needs;
:class:`SingleProcess` is the default. In a job started with ``jax.distributed.initialize(...)`` every process captures, replays
and persists only its own (replica 0) shards; the persist of one step is separated into
"every process writes its own OCDBT database" and "the primary merges and commits" by
barriers (see :mod:`.persist`). :class:`JaxDistributedCoordinator`
implements those barriers on the key-value store of JAX's coordination service, with a
timeout: if a process dies or hangs, the others do not hang with it, they raise
:class:`BarrierTimeoutError` naming the processes that did not arrive, and the store
reports it like any other persist failure (the step is not committed, earlier steps stay
restorable, the error surfaces from the next ``save`` or ``wait_until_finished``).

Why the key-value store and not ``wait_at_barrier``: the runtime's barrier only says that
it timed out; with one key per process we can say *which* process did not arrive, and a
timed-out barrier does not leave the coordination service in an error state.

``CheckpointStore`` picks this coordinator by itself when ``jax.distributed`` is
initialized with more than one process (:func:`default_coordinator`).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Protocol

from .errors import CheckpointError

__all__ = ["Coordinator", "SingleProcess", "JaxDistributedCoordinator", "BarrierTimeoutError",
           "default_coordinator", "distributed_client"]

class Coordinator(Protocol):
    """What the store needs to know about the job's processes (the multi-process seam).

    ``barrier(name)`` is called by every process at the same points of each persist
    (``created``, ``data``, ``committed``). An implementation must raise rather than hang
    when another process failed (e.g. a timeout), so that the failure is reported like any
    other persist error; wiring that to ``jax.distributed`` is left to its caller.
    """

    process_index: int
    process_count: int

    def is_primary(self) -> bool: ...

    def barrier(self, name: str) -> None: ...


class SingleProcess:
    """The default coordinator: one process, which is also the primary."""

    process_index = 0
    process_count = 1

    def is_primary(self) -> bool:
        return True

    def barrier(self, name: str) -> None:
        return None


_STAGES = {
    # barrier stage -> what the missing process had not done yet
    "created": "start persisting step {step}",
    "data": "finish writing step {step}",
    "committed": "acknowledge the commit of step {step}",
}

_instances = itertools.count()


class BarrierTimeoutError(CheckpointError, TimeoutError):
    """Some processes did not reach a checkpoint barrier in time (dead, hung or too slow)."""

    def __init__(self, message: str, *, missing: list[int], barrier: str, step: int | None = None):
        super().__init__(message, step=step)
        self.missing = missing
        self.barrier = barrier


def distributed_client():
    """The client of ``jax.distributed`` in this process, or ``None`` if it is not initialized.

    Never initializes a backend (cheap to call from code that only does storage)."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover - jax without the private module
        return None
    state = distributed.global_state
    return state.client if getattr(state, "client", None) is not None else None


def default_coordinator():
    """:class:`JaxDistributedCoordinator` when ``jax.distributed`` runs more than one
    process, else ``None`` (the store then uses its single-process default)."""
    client = distributed_client()
    if client is None:
        return None
    from jax._src import distributed
    if (distributed.global_state.num_processes or 1) <= 1:
        return None
    return JaxDistributedCoordinator()


def _describe_barrier(name: str, processes: list[int], timeout_s: float) -> tuple[str, int | None]:
    who = (f"process {processes[0]}" if len(processes) == 1
           else "processes " + ", ".join(map(str, processes)))
    parts = name.split(":")
    step = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
    stage = parts[2] if len(parts) == 3 else None
    if step is not None and stage in _STAGES:
        what = _STAGES[stage].format(step=step)
        tail = ("; the step was committed by the primary but this process cannot confirm "
                "that every process saw it" if stage == "committed"
                else "; the step was not committed")
        return f"{who} did not {what} within {timeout_s:g} s{tail}", step
    return f"{who} did not reach barrier {name!r} within {timeout_s:g} s", step


class JaxDistributedCoordinator:
    """Barriers for :class:`~overlap_ckpt.storage.CheckpointStore` over ``jax.distributed``.

    Args:
      timeout_s: how long a barrier waits for the other processes before raising
        :class:`BarrierTimeoutError` (which names them). Must cover the slowest process's
        write of one step, since the ``data`` barrier waits for every process's writes.
      namespace: prefix of the coordination-service keys. Every process must construct
        its coordinators in the same order (the default appends a per-process counter so
        that two stores in one job do not share keys); pass an explicit, distinct
        namespace per store when that order is not guaranteed.
      client, process_index, process_count: for tests; default to ``jax.distributed``'s.

    Every process calls the same barriers in the same order (one persist at a time per
    store, steps in order), so each call gets a sequence number; keys are
    ``<namespace>/<seq>:<name>/<process>`` and a process deletes its own key of a barrier
    once the next one has passed (by then every process has left the earlier one).
    """

    def __init__(self, timeout_s: float = 300.0, *, namespace: str | None = None, client=None,
                 process_index: int | None = None, process_count: int | None = None):
        if client is None:
            client = distributed_client()
            if client is None:
                raise RuntimeError(
                    "JaxDistributedCoordinator needs jax.distributed.initialize() to have been "
                    "called in this process (before creating the CheckpointStore).")
        if process_index is None or process_count is None:
            import jax
            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.namespace = namespace or f"overlap_ckpt/{next(_instances)}"
        self._client = client
        self._seq = 0
        self._previous_key: str | None = None
        self._lock = threading.Lock()

    def is_primary(self) -> bool:
        return self.process_index == 0

    def __repr__(self) -> str:
        return (f"JaxDistributedCoordinator(process {self.process_index} of {self.process_count}, "
                f"timeout_s={self.timeout_s:g})")

    def barrier(self, name: str) -> None:
        """Wait until every process called ``barrier(name)``; raise after ``timeout_s``."""
        with self._lock:
            seq = self._seq
            self._seq += 1
        prefix = f"{self.namespace}/{seq}:{name}/"
        self._client.key_value_set(f"{prefix}{self.process_index}", "1", allow_overwrite=True)
        deadline = time.monotonic() + self.timeout_s
        for other in range(self.process_count):
            if other == self.process_index:
                continue
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            try:
                if remaining_ms <= 0:
                    raise TimeoutError
                self._client.blocking_key_value_get(f"{prefix}{other}", remaining_ms)
            except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED (JaxRuntimeError) or ours
                if not is_timeout(e):
                    raise
                missing = self._missing(prefix)
                message, step = _describe_barrier(name, missing, self.timeout_s)
                raise BarrierTimeoutError(
                    f"{message} (process {self.process_index} waited at barrier {name!r})",
                    missing=missing, barrier=name, step=step) from None
        if self._previous_key is not None:
            try:
                self._client.key_value_delete(self._previous_key)
            except Exception:  # noqa: BLE001 - housekeeping only
                pass
        self._previous_key = f"{prefix}{self.process_index}"

    def _missing(self, prefix: str) -> list[int]:
        try:
            arrived = {int(k.rsplit("/", 1)[1]) for k, _ in self._client.key_value_dir_get(prefix)}
        except Exception:  # noqa: BLE001 - the service itself may be gone
            arrived = {self.process_index}
        return [p for p in range(self.process_count) if p not in arrived]


def is_timeout(e: BaseException) -> bool:
    """Whether a key-value store call gave up waiting (jax raises its gRPC status as text)."""
    return isinstance(e, TimeoutError) or "DEADLINE_EXCEEDED" in str(e)
