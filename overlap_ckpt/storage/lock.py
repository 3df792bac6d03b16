"""One live writer per checkpoint directory.

Why: two managers writing the same directory would delete each other's steps (retention,
cleanup of partial steps) and could both commit the same step. The second one is refused
with :class:`CheckpointLockedError` naming the holder (pid and host).

* **Local directories**: ``<root>/.overlap_ckpt.lock`` held with ``flock``. The kernel
  drops the lock when the holder dies (even by SIGKILL), so a stale lock file of a dead
  pid is simply taken over. pid/host/start time are written into the file for messages.
* **Object stores** (and filesystems without ``flock``): a lease object with pid, host,
  a random token and an expiry, refreshed by a heartbeat thread. An expired lease, or
  one whose pid is dead on this host, is taken over. This is best effort (object stores
  have no compare-and-swap here): a race inside one refresh interval is not detected.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid

from .errors import CheckpointLockedError
from .location import Location, LocalLocation

log = logging.getLogger(__name__)

LOCK_NAME = ".overlap_ckpt.lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')!r} (since {holder.get('started')})"


class DirectoryLock:
    """Exclusive ownership of a checkpoint root for one :class:`CheckpointStore`."""

    def __init__(self, location: Location, *, lease_seconds: float = 60.0):
        self.location = location
        self.lease_seconds = lease_seconds
        self.token = uuid.uuid4().hex
        self._fd: int | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.lost = False

    def _record(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "token": self.token,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "expires": time.time() + self.lease_seconds}

    def _refused(self, holder: dict) -> CheckpointLockedError:
        return CheckpointLockedError(
            f"{self.location.describe()} is already managed by a live CheckpointStore "
            f"({_describe(holder)}). Close that store (store.close()) or use another "
            f"directory; if that process is gone, its lock is taken over automatically.",
            path=self.location.describe())

    # -- acquire/release ----------------------------------------------------------------
    def acquire(self) -> None:
        if isinstance(self.location, LocalLocation):
            try:
                self._acquire_flock()
                return
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                log.warning("flock unsupported on %s (%s); using a lease file", self.location.url, e)
        self._acquire_lease()

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None
        if self._fd is not None:
            try:
                os.unlink(self.location.path(LOCK_NAME))  # while still holding the flock
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
        elif not self.lost:
            holder = self._read_lease()
            if holder is not None and holder.get("token") == self.token:
                if isinstance(self.location, LocalLocation):
                    _unlink_quiet(self.location.path(LOCK_NAME))
                else:
                    self.location.delete_tree(LOCK_NAME)

    # -- flock ------------------------------------------------------------------------------
    def _acquire_flock(self) -> None:
        import fcntl

        loc = self.location
        assert isinstance(loc, LocalLocation)
        loc.root.mkdir(parents=True, exist_ok=True)
        path = loc.path(LOCK_NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _parse(os.pread(fd, 4096, 0))
                os.close(fd)
                raise self._refused(holder) from None
            except BaseException:
                os.close(fd)
                raise
            # The previous holder unlinks the file before unlocking: make sure we locked the
            # file that is still at ``path``, not an orphaned inode.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _parse(os.pread(fd, 4096, 0))
        if previous.get("pid"):
            log.warning("Taking over the stale lock of %s on %s (that process is gone).",
                        _describe(previous), loc.url)
        data = json.dumps(self._record()).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self._fd = fd

    # -- lease --------------------------------------------------------------------------------
    def _read_lease(self) -> dict | None:
        raw = self.location.read_bytes(LOCK_NAME, 1 << 16)
        return None if raw is None else _parse(raw)

    def _acquire_lease(self) -> None:
        holder = self._read_lease()
        if holder and holder.get("token") != self.token:
            expired = float(holder.get("expires", 0)) < time.time()
            dead_here = (holder.get("host") == socket.gethostname()
                         and isinstance(holder.get("pid"), int) and not _pid_alive(holder["pid"]))
            if not (expired or dead_here):
                raise self._refused(holder)
            log.warning("Taking over the stale lease of %s on %s.", _describe(holder), self.location.url)
        self.location.write_bytes(LOCK_NAME, json.dumps(self._record()).encode())
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._renew, name="overlap-ckpt-lease", daemon=True)
        self._heartbeat.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                holder = self._read_lease()
                if holder is not None and holder.get("token") != self.token:
                    self.lost = True
                    log.error("The lease on %s was taken by %s; this store stops renewing it.",
                              self.location.url, _describe(holder))
                    return
                self.location.write_bytes(LOCK_NAME, json.dumps(self._record()).encode())
            except Exception:  # noqa: BLE001 - a transient failure must not kill the heartbeat
                log.exception("Renewing the lease on %s failed; retrying.", self.location.url)


def _parse(raw: bytes) -> dict:
    try:
        doc = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _unlink_quiet(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
