"""The bulk transport of the local tier's peer replicas: bytes from one process straight to
another through ``jax.experimental.transfer``, not through the coordinator.

Why: jax.distributed's key-value store (what :class:`overlap_ckpt.tiers.peers.Channel` used for
every byte) passes each value through process 0, the coordination service, at about
35 MB/s on a 2-core machine: a GB-scale shard per process then lags far behind training,
and process 0 relays every replica of the job. jax's transfer library runs a small socket
server in each process (started here once per process, on the CPU backend's client) from
which another process pulls arrays directly. A replica is host bytes (a tar archive), so
it travels as uint8 arrays on this process's CPU device, whatever backend trains (the CPU
client exists on GPU and TPU hosts too). The key-value store carries only small messages:
each process's server address, the head of a message, the acknowledgements.

How a message moves (:meth:`BulkTransport.offer`, :meth:`BulkTransport.fetch`): the sender
wraps the bytes as arrays of at most :data:`CHUNK_BYTES` (aliasing them, not copying:
:func:`_to_arrays`), registers them under one random id per receiver (``await_pull``; a
pull consumes its registration), keeps them until the receivers acknowledged
(:meth:`BulkTransport.release`), and the caller publishes the head that names the ids only
then, so a receiver never pulls before the sender awaits it. A registration nobody pulls
expires on its own (the sender's ``await_pull`` deadline), so a receiver that died costs
memory for a bounded time only. The receiver hashes each chunk as it lands, while the
next ones are still on their way.

Every wait is bounded: jax's ``pull`` has no deadline of its own on the client side (its
``timeout`` did not fire in jax 0.10.2, and a pull from a server that is gone retries the
connection every 2 s forever, measured), so each pull runs on a connection of its own that
a watchdog poisons at the deadline: the pull then fails with an error that names the
process it waited for. A message of 0 bytes has no arrays (a zero-size pull never
completes, measured).

Fallback: where the transfer server cannot start (no CPU backend, a jaxlib without it, no
address to bind), a process logs why and publishes an empty address; messages from or to
it then go through the key-value store, as before (:class:`overlap_ckpt.tiers.peers.Channel`).
"""

from __future__ import annotations

import bisect
import datetime
import io
import itertools
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

import numpy as np

from ..storage import CheckpointError
from ..storage.coordination import is_timeout

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # one array of a message: bounds the size of each buffer pulled
TRANSFER_BYTES = 4 << 20  # the server's copy unit (jax's default 256 MiB x 8 reserves 4 GiB)
PARALLEL_COPIES = 4  # copies in flight per server: with TRANSFER_BYTES, ~48 MiB reserved
ALIGN = 64  # the CPU client aliases a host buffer with this alignment instead of copying it
HOST_ENV = "OVERLAP_CKPT_TRANSFER_HOST"  # the address peers reach this process at (a multi-NIC host)

_started: dict[str, Any] = {}  # this process's server and CPU device, or why it could not start
_start_lock = threading.Lock()


def chunk_sizes(nbytes: int, lead: int = 0) -> list[int]:
    """The sizes of the arrays a message of ``nbytes`` travels as (none for 0 bytes): ``lead``
    bytes first (see :func:`_to_arrays`), then chunks of at most :data:`CHUNK_BYTES`."""
    lead = min(lead, nbytes)
    return ([lead] if lead else []) + [min(CHUNK_BYTES, nbytes - offset) for offset in range(lead, nbytes, CHUNK_BYTES)]


def _host() -> str:
    """The address peers reach this process at: the interface that routes to the
    coordinator (the network the job already uses), ``127.0.0.1`` without jax.distributed."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    try:
        from jax._src import distributed
        coordinator = distributed.global_state.coordinator_address
    except (ImportError, AttributeError):  # pragma: no cover - jax without the private module
        coordinator = None
    if not coordinator:
        return "127.0.0.1"
    host, _, port = coordinator.rpartition(":")
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:  # UDP: picks a route, sends nothing
        probe.connect(address)
        return probe.getsockname()[0]


def _start_server() -> tuple[Any, Any]:
    import jax
    from jax.experimental import transfer

    if not hasattr(transfer.TransferConnection, "_poison_connection"):
        raise RuntimeError("this jax cannot abandon a pull (TransferConnection._poison_connection): a pull "
                           "from a dead process could not be bounded")
    device = jax.local_devices(backend="cpu")[0]  # jax.devices("cpu")[0] is process 0's
    host = _host()
    address = f"[{host}]:0" if ":" in host else f"{host}:0"
    server = transfer.start_transfer_server(device.client, address, [address],
                                            max_num_parallel_copies=PARALLEL_COPIES, transfer_size=TRANSFER_BYTES)
    return server, device


def local_server() -> tuple[Any, Any] | None:
    """This process's transfer server and CPU device, started on first use; ``None`` when it
    cannot start (logged once, with the reason: the caller falls back to the key-value store)."""
    with _start_lock:
        if not _started:
            try:
                _started["server"], _started["device"] = _start_server()
                log.info("replica transfer server of this process listens at %s", _started["server"].address())
            except Exception as e:  # noqa: BLE001 - any reason: fall back, say why
                _started["error"] = f"{type(e).__name__}: {e}"
                log.warning("the replica transfer server could not start (%s): replicas to and from this "
                            "process go through jax.distributed's key-value store (process 0, slow)",
                            _started["error"])
        if "error" in _started:
            return None
        return _started["server"], _started["device"]


def _to_arrays(data: bytes, device: Any) -> tuple[list[Any], int]:
    """``data`` as uint8 arrays on ``device`` (:func:`chunk_sizes`), and the ``lead`` that
    aligns them: the CPU client takes a host buffer aligned to :data:`ALIGN` bytes as it is,
    without a copy, so a lead of a few bytes lets every chunk after it alias ``data``
    (which the arrays keep alive). Where it copies instead, only the time differs."""
    import jax

    view = np.frombuffer(data, np.uint8)
    lead = (-view.ctypes.data) % ALIGN if len(data) else 0
    arrays, offset = [], 0
    for size in chunk_sizes(len(data), lead):
        arrays.append(jax.device_put(view[offset:offset + size], device))
        offset += size
    return jax.block_until_ready(arrays), lead


class Chunks:
    """A message's bytes as the buffers they arrived in. Joining them into one ``bytes``
    would allocate and copy the whole archive again (about a seventh of a 256 MiB replica's
    time on a 2-core machine, and twice the receiver's memory); tarfile reads them through
    :meth:`reader` instead."""

    def __init__(self, buffers: list[Any]):
        self._views = [memoryview(b).cast("B") for b in buffers]

    def __len__(self) -> int:
        return sum(len(v) for v in self._views)

    def __bytes__(self) -> bytes:
        return b"".join(self._views)

    def __eq__(self, other: object) -> bool:
        try:
            other_view = memoryview(bytes(other) if isinstance(other, Chunks) else other).cast("B")
        except TypeError:
            return NotImplemented
        if len(other_view) != len(self):
            return False
        offset = 0
        for view in self._views:
            if view != other_view[offset:offset + len(view)]:
                return False
            offset += len(view)
        return True

    __hash__ = None  # type: ignore[assignment]

    def reader(self) -> io.BufferedReader:
        """A seekable, read-only file over the bytes."""
        return io.BufferedReader(_ChunkReader(self._views))


class _ChunkReader(io.RawIOBase):
    def __init__(self, views: list[memoryview]):
        self._views = views
        self._starts = list(itertools.accumulate((len(v) for v in views), initial=0))
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._starts[-1]}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out, done = memoryview(buffer).cast("B"), 0
        while done < len(out) and self._pos < self._starts[-1]:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            view = self._views[i][self._pos - self._starts[i]:]
            n = min(len(view), len(out) - done)
            out[done:done + n] = view[:n]
            done, self._pos = done + n, self._pos + n
        return done


class BulkTransport:
    """This process's end of the peer-to-peer transport: it publishes its server's address
    (``""`` when it has none) under ``<prefix>/bulk/<process>``, offers bytes to receivers
    and pulls the bytes offered to it.

    Args:
      client: jax.distributed's client (the key-value store, for addresses only).
      prefix: key-value prefix (the same on every process).
      process_index: this process.
      enabled: ``False``: publish no address, so that every message from or to this
        process goes through the key-value store (the benchmark's comparison).
    """

    def __init__(self, client: Any, prefix: str, process_index: int, *, enabled: bool = True):
        started = local_server() if enabled else None
        self._server, self._device = started if started else (None, None)
        self._client, self._prefix, self._me = client, prefix, process_index
        self._addresses: dict[int, str] = {}
        self._offers: dict[str, list[Any]] = {}  # message key -> its arrays, alive until acknowledged
        self._lock = threading.Lock()
        client.key_value_set(self._key(process_index), self.address or "", allow_overwrite=True)

    @property
    def address(self) -> str | None:
        return self._server.address() if self._server is not None else None

    def _key(self, process: int) -> str:
        return f"{self._prefix}/bulk/{process}"

    def address_of(self, process: int, timeout_s: float) -> str:
        """``process``'s server address (``""``: it has none), waiting at most ``timeout_s``
        for it to publish it."""
        with self._lock:
            if process in self._addresses:
                return self._addresses[process]
        try:
            address = self._client.blocking_key_value_get(self._key(process), int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - DEADLINE_EXCEEDED from the coordination service
            if is_timeout(e):
                raise CheckpointError(f"process {process} did not publish its replica transfer address within "
                                      f"{timeout_s:.0f} s") from e
            raise
        if not address:
            log.warning("process %d has no replica transfer server: messages between it and process %d go "
                        "through the key-value store", process, self._me)
        with self._lock:
            self._addresses[process] = address
        return address

    def reaches(self, processes: list[int], timeout_s: float) -> bool:
        """Whether bytes can go from this process to each of ``processes`` peer to peer."""
        return self._server is not None and all(self.address_of(p, timeout_s) for p in processes)

    def offer(self, key: str, data: bytes, receivers: list[int], timeout_s: float) -> dict[str, Any]:
        """Make ``data`` pullable once by each receiver, for ``timeout_s``; returns what a
        receiver's :meth:`fetch` needs besides the size (JSON: the id each receiver pulls it
        under, by process as a string, and the arrays' ``lead``). The arrays stay alive
        until :meth:`release` (a message sent again under ``key`` replaces its offer)."""
        arrays, lead = _to_arrays(data, self._device)
        expiry = datetime.datetime.fromtimestamp(time.time() + timeout_s)
        ids = {str(p): secrets.randbits(63) for p in receivers}
        if arrays:
            for uuid in ids.values():
                self._server.await_pull(uuid, arrays, timeout=expiry)
        with self._lock:
            self._offers[key] = arrays
        return {"uuids": ids, "lead": lead}

    def release(self, key: str) -> None:
        """The receivers answered: drop this process's references to the message's arrays."""
        with self._lock:
            self._offers.pop(key, None)

    def fetch(self, source: int, offer: dict[str, Any], nbytes: int, timeout_s: float,
              digest: Any = None) -> Chunks:
        """The ``nbytes`` that ``source`` offered this process (``offer``: what its
        :meth:`offer` returned); :class:`CheckpointError` naming ``source`` if they did not
        all arrive within ``timeout_s`` (a dead sender, an expired offer) or the pull failed.
        ``digest`` (a hashlib object) is updated with each chunk as it arrives, while the
        next ones are still on their way."""
        import jax

        if nbytes == 0:
            return Chunks([])
        address = self.address_of(source, timeout_s)
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        shapes = [jax.ShapeDtypeStruct((n,), np.uint8, sharding=sharding)
                  for n in chunk_sizes(nbytes, offer["lead"])]
        connection = self._server.connect(address)  # its own: the watchdog poisons only this pull
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            connection._poison_connection()  # the pending pull fails instead of waiting forever

        watchdog = threading.Timer(timeout_s, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            arrays = connection.pull(offer["uuids"][str(self._me)], shapes)
            views = []
            for array in arrays:  # in order: each chunk is hashed while the next ones land
                views.append(np.asarray(array.block_until_ready()))
                if digest is not None:
                    digest.update(views[-1])
            return Chunks(views)
        except Exception as e:  # noqa: BLE001 - poisoned, or the sender's server failed the pull
            if expired.is_set():
                raise CheckpointError(f"the {nbytes} bytes offered by process {source} (transfer server "
                                      f"{address}) did not arrive within {timeout_s:.0f} s: is process "
                                      f"{source} alive?") from e
            raise CheckpointError(f"pulling {nbytes} bytes from process {source} (transfer server {address}) "
                                  f"failed: {type(e).__name__}: {e}") from e
        finally:
            watchdog.cancel()


__all__ = ["BulkTransport", "Chunks", "CHUNK_BYTES", "chunk_sizes", "local_server"]
