"""Peer replicas of the local tier: each process also keeps the local-tier steps of
``replicas`` other processes, so that the shards of a lost host survive on a peer.

Why: a local tier on tmpfs survives a crashed process, not a lost host (a replaced machine,
a reboot that clears ``/dev/shm``). With ``LocalTier(replicas=R)`` process ``i`` also holds
the committed local steps of processes ``i+1 .. i+R`` (mod N), byte for byte, under
``<its local directory>/replicas/process_<j>/<step>``: the same Orbax layout, committed with
the same atomic protocol (tmp directory, fsync, rename) and listed only when its metadata
reads back, it was written by process ``j`` of a job of this size and every file has the
size it had on ``j``. A restore then finds every process's shards of a step in some
process's local tier as long as no R+1 consecutive processes are lost.

Transport (:mod:`overlap_ckpt.tiers.transport`): a committed step directory travels as a
tar archive, its bytes peer to peer through ``jax.experimental.transfer`` (a socket server
per process, on the CPU backend's client: the receiver pulls the archive straight from the
sender), with its sha256 checked on arrival. jax.distributed's key-value store (the
coordination service the job already runs) carries only small messages: each process's
server address, the head of each message (size, sha256, pull ids), the acknowledgements.
Where a process's transfer server cannot start (logged), messages from and to it carry
their bytes through the key-value store instead, in parts of 4 MiB: every byte then passes
through the coordinator (process 0), at about 35 MB/s on a 2-core machine.
Why not jax's CPU collectives: a collective issued from a background
thread may be launched before the training step's own collectives on one process and after
them on another (the CPU client runs one collective program at a time: a deadlock when
training runs on the CPU backend), and one issued from the training thread would stall
training for the whole transfer. Key-value calls (RPCs) and pulls (socket reads) are safe
from any thread, and every wait on a peer is bounded (``TIMEOUT_S``), with an error that
names the peer.

Replication runs in the background: after a local step commits, a sender thread publishes
the newest committed step not yet on the holders and waits for their acknowledgements, then
the next newest, down to the oldest step the local tier keeps (``max_to_keep``). Newest
first, because a restore wants the newest step; the older ones too, because a restore falls
back to them when the newest is torn somewhere, so the replicas hold what the local tier
holds. A sender that falls behind never queues more than ``max_to_keep`` steps. One
receiver thread per source process installs what arrives. A replica that failed (a full
tmpfs, a corrupt transfer, a holder that never answered) is reported as a
:class:`CheckpointError` at the next ``mngr.step``, like a failed write.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
import threading
import time
from typing import Any, Callable

from .transport import BulkTransport, Chunks
from ..storage import CheckpointError, CorruptCheckpointError, commit, layout, restore
from ..storage.coordination import is_timeout
from ..storage.location import LocalLocation

log = logging.getLogger(__name__)

TIER_KEY = "local_tier"  # custom step metadata: which process of how many wrote the step
SIZES = "_overlap_ckpt_replica.json"  # in a replica's step directory: each file's size on its writer
_PART_BYTES = 4 << 20  # key-value values: far below gRPC limits, and faster than large ones
_POLL_MS = 1000  # receivers look for new steps (and for close) this often
TIMEOUT_S = 300.0  # a peer that does not answer a transfer within this is reported

OwnSteps = Callable[[], tuple[LocalLocation, list[int]]]


def writer_tag(process: int, processes: int) -> dict[str, int]:
    """The custom metadata a local-tier step carries: who wrote it, in a job of which size."""
    return {"process": process, "processes": processes}


def intact_steps(location: LocalLocation, steps: list[int], item_name: str, tag: dict[str, int]) -> list[int]:
    """The committed ``steps`` of ``location`` that read back and were written by ``tag``'s
    process: a damaged or foreign step is logged and left out, never chosen."""
    good = []
    for step in steps:
        try:
            meta = restore.open_step(location, step, layout.step_dir(step), item_name).custom_metadata
            _check_sizes(location, step)
        except CheckpointError as e:
            log.warning("local-tier step %d in %s is damaged (%s); not used", step, location.url, e)
            continue
        if (meta or {}).get(TIER_KEY) == tag:
            good.append(step)
    return good


def _check_sizes(location: LocalLocation, step: int) -> None:
    """A replica records the size of each of its files on the writer: a truncated or lost
    file (a torn copy) fails here, before a restore would read it."""
    raw = location.read_bytes(f"{layout.step_dir(step)}/{SIZES}", layout.MAX_METADATA_BYTES)
    if raw is None:
        return  # this process's own step: the store's own write protocol covers it
    for rel, size in layout.loads(raw, location.describe(SIZES)).items():
        path = location.path(f"{layout.step_dir(step)}/{rel}")
        if not path.is_file() or path.stat().st_size != size:
            raise CorruptCheckpointError(f"{path} is missing or not {size} bytes: the replica is torn",
                                         step=step, path=str(path))


def pack(location: LocalLocation, step: int) -> bytes:
    """The committed step directory ``step`` of ``location`` as a tar archive."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(location.path(layout.step_dir(step)), arcname=layout.step_dir(step))
    return buffer.getvalue()


def install(location: LocalLocation, step: int, archive: bytes | Chunks) -> None:
    """Write :func:`pack`'s archive (as packed, or as received) as committed step ``step``
    of ``location``, atomically (replacing a committed step of that number, which a
    restarted job writes again)."""
    work, name = commit.working_dir(location, step), layout.step_dir(step)
    commit.delete_incomplete(location, step)
    sizes = {}
    with tarfile.open(fileobj=archive.reader() if isinstance(archive, Chunks) else io.BytesIO(archive)) as tar:
        for member in tar:
            top, _, rel = member.name.partition("/")
            if top != name or (not member.isdir() and not member.isfile()):
                raise CheckpointError(f"the replica archive of step {step} holds {member.name!r}, "
                                      f"not a file of step directory {name}/", step=step)
            if member.isdir():
                location.make_dir(f"{work}/{rel}" if rel else work)
                continue
            data = tar.extractfile(member).read()
            location.write_bytes(f"{work}/{rel}", data)
            if rel not in (layout.COMMIT_MARKER, SIZES):  # commit() writes its own marker; the
                sizes[rel] = len(data)  # record of a replica sent on is written anew below
    location.write_bytes(f"{work}/{SIZES}", layout.dumps(sizes))
    if location.is_dir(name):
        commit.delete_step(location, step)
    commit.commit(location, step)


class Channel:
    """Messages from one process to others: a head (size, sha256, the sender's fields)
    through jax.distributed's key-value store, the bytes peer to peer
    (:class:`~overlap_ckpt.tiers.transport.BulkTransport`), then one acknowledgement per
    receiver through the store; the sender drops the message once acknowledged.

    The bytes go through the key-value store instead, in parts of 4 MiB, only where the
    sender or a receiver has no transfer server (it could not start: logged), or with
    ``bulk=False`` (the benchmark's comparison)."""

    def __init__(self, client: Any, prefix: str, process_index: int, *, bulk: bool = True):
        self._client = client
        self._prefix = prefix
        self._me = process_index
        self._bulk = BulkTransport(client, prefix, process_index, enabled=bulk)

    def send(self, key: str, data: bytes, receivers: list[int], **fields: Any) -> None:
        """Offer ``data`` to ``receivers``, then publish its head (a message sent again
        under ``key`` replaces the earlier one)."""
        base = f"{self._prefix}/{key}"
        head = {**fields, "from": self._me, "nbytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if self._bulk.reaches(receivers, TIMEOUT_S):
            # Offered for twice the acknowledgement timeout: never pulled, it expires by itself.
            head["bulk"] = self._bulk.offer(key, data, receivers, 2 * TIMEOUT_S)
        else:
            head["parts"] = max(1, -(-len(data) // _PART_BYTES))
            view = memoryview(data)
            for n in range(head["parts"]):
                self._client.key_value_set_bytes(f"{base}/part/{n}",
                                                 bytes(view[n * _PART_BYTES:(n + 1) * _PART_BYTES]),
                                                 allow_overwrite=True)
        self._client.key_value_set(f"{base}/head", json.dumps(head), allow_overwrite=True)

    def receive(self, key: str, timeout_ms: int) -> tuple[dict, bytes | Chunks]:
        """The message ``key``: raises ``TimeoutError`` if no head arrives within
        ``timeout_ms``, :class:`CheckpointError` if its bytes do not arrive within
        ``TIMEOUT_S`` or are not the ones sent."""
        base = f"{self._prefix}/{key}"
        try:
            head = json.loads(self._client.blocking_key_value_get(f"{base}/head", timeout_ms))
        except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED from the coordination service
            if is_timeout(e):
                raise TimeoutError(f"no message {key!r} within {timeout_ms} ms") from e
            raise
        digest = hashlib.sha256()
        if "bulk" in head:
            data = self._bulk.fetch(head["from"], head["bulk"], head["nbytes"], TIMEOUT_S, digest)
        else:
            data = b"".join(self._client.blocking_key_value_get_bytes(f"{base}/part/{n}", timeout_ms)
                            for n in range(head["parts"]))
            digest.update(data)
        if len(data) != head["nbytes"] or digest.hexdigest() != head["sha256"]:
            raise CheckpointError(f"the bytes of {key!r} from process {head['from']} arrived damaged "
                                  f"({len(data)} of {head['nbytes']} bytes, or a different sha256)")
        return head, data

    def ack(self, key: str, error: str | None = None) -> None:
        self._client.key_value_set(f"{self._prefix}/{key}/ack/{self._me}", error or "", allow_overwrite=True)

    def close(self) -> None:
        """Tell senders that this process receives nothing more."""
        self._client.key_value_set(f"{self._prefix}/closed/{self._me}", "", allow_overwrite=True)

    def closed(self, process: int) -> bool:
        try:
            self._client.key_value_try_get(f"{self._prefix}/closed/{process}")
        except Exception:  # noqa: BLE001 - NOT_FOUND: still receiving
            return False
        return True

    def wait_acks(self, key: str, receivers: list[int], timeout_s: float,
                  stop: threading.Event | None = None) -> dict[int, str | None]:
        """Each receiver's answer (``""`` when it installed the message, ``None`` when it
        closed before it came), then the message is deleted; a receiver that did not answer
        within ``timeout_s`` (or before ``stop``) gets an error."""
        base = f"{self._prefix}/{key}"
        answers: dict[int, str | None] = {}
        deadline = time.monotonic() + timeout_s
        for p in receivers:
            while p not in answers:
                try:
                    answers[p] = self._client.blocking_key_value_get(f"{base}/ack/{p}", _POLL_MS)
                except Exception as e:  # noqa: BLE001
                    if not is_timeout(e):
                        answers[p] = f"{type(e).__name__}: {e}"
                    elif self.closed(p):
                        answers[p] = None
                    elif time.monotonic() > deadline or (stop is not None and stop.is_set()):
                        answers[p] = f"process {p} did not acknowledge within {timeout_s:.0f} s"
        self._bulk.release(key)
        try:
            self._client.key_value_delete(f"{base}/")
        except Exception:  # noqa: BLE001 - the service may be going away with the job
            log.debug("deleting %s from the key-value store failed", base, exc_info=True)
        return answers


class PeerReplicas:
    """This process's part of the replication ring: it sends its newest committed local
    step to the ``replicas`` processes before it and holds those of the ``replicas``
    processes after it.

    Args:
      client: jax.distributed's client.
      namespace: key-value prefix of this tiered store (the same on every process).
      own_dir: this process's local-tier directory; replicas go under ``<own_dir>/replicas``.
      own_steps: waits for this process's queued local writes, then returns its local
        location and intact steps (the sender's view).
      item_name: the Orbax item of the steps.
      max_to_keep: replica steps kept per source process.
    """

    def __init__(self, client: Any, namespace: str, *, process_index: int, process_count: int, replicas: int,
                 own_dir: str, own_steps: OwnSteps, item_name: str, max_to_keep: int):
        self.process_index, self.process_count = process_index, process_count
        self.sources = [(process_index + k) % process_count for k in range(1, replicas + 1)]
        self.holders = [(process_index - k) % process_count for k in range(1, replicas + 1)]
        self.held = {j: LocalLocation(os.path.join(own_dir, "replicas", f"process_{j}")) for j in self.sources}
        self._channel = Channel(client, namespace, process_index)
        self._own_steps, self._item_name, self._max_to_keep = own_steps, item_name, max_to_keep
        self._cv = threading.Condition()
        self._asked = self._seen = 0  # local steps handed over / looked at by the sender
        self._busy = False
        self._sent: set[int] = set()  # kept local steps every holder acknowledged
        self._sequence = 0
        self._errors: list[CheckpointError] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- background replication -------------------------------------------------------------
    def start(self) -> None:
        """Start the sender and one receiver per source (a manager that trains)."""
        if self._threads:
            return
        self._threads = [threading.Thread(target=self._send_loop, name="overlap-ckpt-replica-send", daemon=True)]
        self._threads += [threading.Thread(target=self._receive_loop, args=(j,), daemon=True,
                                           name=f"overlap-ckpt-replica-from-{j}") for j in self.sources]
        for thread in self._threads:
            thread.start()

    def notify(self) -> None:
        """A local step was handed to the local store: replicate it once committed."""
        with self._cv:
            self._asked += 1
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until the newest committed local step is on every holder (or failed)."""
        with self._cv:
            while self._threads and self._threads[0].is_alive() and (self._busy or self._seen < self._asked):
                self._cv.wait()

    def take_errors(self) -> list[CheckpointError]:
        with self._cv:
            errors, self._errors = self._errors, []
        return errors

    def close(self) -> None:
        """Flush, then stop: senders stop waiting for this process, and a step a peer
        publishes later is not held here (no barrier: a process closing on an error must
        not wait for peers that may be stuck)."""
        if not self._threads:
            return
        self.flush()
        try:
            self._channel.close()
        except Exception as e:  # noqa: BLE001 - the service is gone with the job
            log.warning("could not tell the peers that process %d closed: %s", self.process_index, e)
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while self._seen == self._asked and not self._stop.is_set():
                    self._cv.wait()
                if self._stop.is_set():
                    return
                self._seen, self._busy = self._asked, True
            try:
                while not self._stop.is_set() and self._send_next():
                    pass
            except Exception as e:  # noqa: BLE001 - e.g. the coordination service is gone
                self._fail(CheckpointError(f"replicating the local tier of process {self.process_index} "
                                           f"failed: {type(e).__name__}: {e}"))
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _send_next(self) -> bool:
        """Send the newest kept local step the holders lack; False when there is none, or
        when a holder failed it (tried again at the next local step)."""
        location, steps = self._own_steps()
        kept = steps[-self._max_to_keep:]
        with self._cv:
            self._sent.intersection_update(kept)
            unsent = [s for s in kept if s not in self._sent]
        if not unsent:
            return False
        step = unsent[-1]
        try:
            data = pack(location, step)
        except OSError:
            if step in self._own_steps()[1]:
                raise
            log.info("local step %d was retired before its replicas were sent", step)
            return True
        key = f"ring/{self.process_index}/{self._sequence}"  # the receivers take them in sequence
        self._channel.send(key, data, self.holders, step=step)  # a send that failed is retried under the same key
        self._sequence += 1
        answers = self._channel.wait_acks(key, self.holders, TIMEOUT_S, self._stop)
        failed = {p: a for p, a in answers.items() if a}
        for p in (p for p, a in answers.items() if a is None):
            log.info("process %d closed before it received local step %d of process %d", p, step,
                     self.process_index)
        if failed:
            self._fail(CheckpointError(f"the replica of local step {step} of process {self.process_index} "
                                       f"failed on {failed}", step=step))
            return False
        with self._cv:
            self._sent.add(step)
        return True

    def _receive_loop(self, source: int) -> None:
        sequence = 0
        while not self._stop.is_set():
            key = f"ring/{source}/{sequence}"
            try:
                head, data = self._channel.receive(key, _POLL_MS)
            except TimeoutError:
                continue
            except CheckpointError as e:  # damaged on the way: the sender reports it
                self._channel.ack(key, str(e))
                sequence += 1
                continue
            except Exception as e:  # noqa: BLE001 - the service is unreachable: try again
                log.warning("waiting for the local steps of process %d: %s", source, e)
                self._stop.wait(_POLL_MS / 1000)
                continue
            sequence += 1
            try:
                self._keep(source, head["step"], data)
            except Exception as e:  # noqa: BLE001 - reported by the sender, as a failed write
                log.error("the replica of step %s of process %d failed here: %s", head["step"], source, e)
                self._channel.ack(key, f"{type(e).__name__}: {e}")
            else:
                self._channel.ack(key)

    def _keep(self, source: int, step: int, data: bytes | Chunks) -> None:
        location = self.held[source]
        install(location, step, data)
        for old in commit.list_steps(location).complete[:-self._max_to_keep]:
            commit.delete_step(location, old)

    def _fail(self, error: CheckpointError) -> None:
        log.error("%s", error)
        with self._cv:
            self._errors.append(error)

    # -- restore ----------------------------------------------------------------------------
    def held_steps(self) -> dict[int, list[int]]:
        """Intact replica steps this process holds, by source process."""
        return {j: intact_steps(loc, commit.list_steps(loc).complete, self._item_name,
                                writer_tag(j, self.process_count)) for j, loc in self.held.items()}

    def drop_after(self, step: int) -> None:
        """Delete held replica steps newer than ``step`` (the job resumes from ``step``), and
        send this process's steps after ``step`` again when they are written again."""
        with self._cv:
            self._sent = {s for s in self._sent if s <= step}
        for location in self.held.values():
            for s in commit.list_steps(location).complete:
                if s > step:
                    commit.delete_step(location, s)

    def hand_over(self, step: int, sources: dict[int, int], own: LocalLocation, agreement: int) -> None:
        """Give each process whose own copy of ``step`` is gone its shards from the process
        ``sources[p]`` that holds their replica, installed as its own local step (collective:
        every process calls it with the same ``sources``)."""
        me = self.process_index
        outgoing = [p for p, q in sorted(sources.items()) if q == me and p != me]
        for p in outgoing:
            self._channel.send(f"restore/{agreement}/{p}", pack(self.held[p], step), [p], step=step)
        if sources[me] != me:
            key = f"restore/{agreement}/{me}"
            try:
                _, data = self._channel.receive(key, int(TIMEOUT_S * 1000))
                install(own, step, data)
            except Exception as e:
                self._channel.ack(key, f"{type(e).__name__}: {e}")
                raise CheckpointError(f"process {me} could not get its shards of local step {step} from "
                                      f"process {sources[me]}: {e}", step=step) from e
            self._channel.ack(key)
        for p in outgoing:
            answer = self._channel.wait_acks(f"restore/{agreement}/{p}", [p], TIMEOUT_S)[p]
            if answer != "":
                raise CheckpointError(f"process {p} could not install its shards of local step {step} "
                                      f"sent by process {me}: {answer or 'it had closed'}", step=step)


__all__ = ["PeerReplicas", "Channel", "pack", "install", "intact_steps", "writer_tag", "TIER_KEY"]
