"""Where checkpoints live: a local directory or a TensorStore kvstore URL.

Why an abstraction: POSIX directories give us an atomic ``rename`` and ``fsync``; object
stores (s3, gcs) have neither, so their commit is a marker object written last. Everything
above this module speaks in ``/``-separated paths relative to the checkpoint root and
asks :attr:`Location.atomic_rename` which commit protocol applies.

Every relative path handed to a :class:`Location` goes through :func:`safe_relpath`, so a
name read from disk can never address anything outside the root.
"""

from __future__ import annotations

import abc
import json
import os
import pathlib
import shutil
from typing import Any

import tensorstore as ts

from .errors import InvalidMetadataError

# A process-wide parent context: its ``memory_key_value_store`` makes ``memory://`` roots
# behave like one shared in-process bucket (two stores on the same URL see the same data).
_ROOT_CONTEXT = ts.Context()


def root_context() -> ts.Context:
    return _ROOT_CONTEXT


def safe_relpath(rel: str) -> str:
    """Validate a relative path from code or disk; refuse absolute paths and ``..``."""
    if not isinstance(rel, str) or "\x00" in rel or "\\" in rel:
        raise InvalidMetadataError(f"Refusing unsafe checkpoint path {rel!r}.")
    if rel.startswith("/"):
        raise InvalidMetadataError(f"Refusing absolute path {rel!r} inside a checkpoint.")
    parts = [p for p in rel.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise InvalidMetadataError(f"Refusing path {rel!r}: it would leave the checkpoint directory.")
    return "/".join(parts)


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class Location(abc.ABC):
    """A checkpoint root. Paths are relative, ``/``-separated, validated by :func:`safe_relpath`."""

    url: str
    #: True when directories can be renamed atomically (POSIX); else commit markers are used.
    atomic_rename: bool

    @abc.abstractmethod
    def kvstore_spec(self, rel: str) -> dict[str, Any]:
        """TensorStore kvstore spec (JSON) of the directory ``rel`` (trailing ``/``)."""

    @abc.abstractmethod
    def list_children(self, rel: str = "") -> list[str]:
        """Names of the immediate children (files and directories) of ``rel``."""

    @abc.abstractmethod
    def read_bytes(self, rel: str, limit: int) -> bytes | None:
        """Contents of file ``rel`` or ``None`` if absent; refuses files larger than ``limit``."""

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write (and make durable) file ``rel``, creating parent directories."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abc.abstractmethod
    def delete_tree(self, rel: str) -> None:
        """Delete ``rel`` and everything below; a missing path is not an error."""

    def is_dir(self, rel: str) -> bool:
        """Whether ``rel`` is a directory (object stores: any prefix is one)."""
        return True

    def make_dir(self, rel: str) -> None:
        """Create directory ``rel`` (no-op on object stores, where directories are implicit)."""

    def sync_tree(self, rel: str) -> None:
        """Make every directory entry below ``rel`` durable (no-op on object stores)."""

    def rename(self, src: str, dst: str) -> None:
        raise NotImplementedError("rename is only available where atomic_rename is True")

    def describe(self, rel: str = "") -> str:
        return f"{self.url.rstrip('/')}/{safe_relpath(rel)}" if rel else self.url


class LocalLocation(Location):
    """A POSIX directory: tmp dir + fsync + atomic rename."""

    atomic_rename = True

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(os.path.abspath(os.fspath(root)))
        self.url = str(self.root)

    def path(self, rel: str = "") -> pathlib.Path:
        rel = safe_relpath(rel)
        return self.root / rel if rel else self.root

    def kvstore_spec(self, rel: str) -> dict[str, Any]:
        return {"driver": "file", "path": str(self.path(rel)) + "/"}

    def list_children(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.path(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def is_dir(self, rel: str) -> bool:
        return self.path(rel).is_dir()

    def read_bytes(self, rel: str, limit: int) -> bytes | None:
        path = self.path(rel)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > limit:
                    raise InvalidMetadataError(
                        f"{path} is {size} bytes, more than the {limit} allowed for a metadata "
                        "file; the checkpoint is corrupt or not a checkpoint.", path=str(path))
                return f.read(limit + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def make_dir(self, rel: str) -> None:
        self.path(rel).mkdir(parents=True, exist_ok=True)

    def delete_tree(self, rel: str) -> None:
        path = self.path(rel)
        if path == self.root:
            raise ValueError("refusing to delete the checkpoint root")
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass

    def sync_tree(self, rel: str) -> None:
        top = self.path(rel)
        for dirpath, _dirnames, _files in os.walk(top):
            fsync_dir(dirpath)
        fsync_dir(top.parent)

    def rename(self, src: str, dst: str) -> None:
        os.rename(self.path(src), self.path(dst))
        fsync_dir(self.path(dst).parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that entries created/renamed in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class KvLocation(Location):
    """A TensorStore kvstore URL (``memory://``, ``s3://``, ``gs://``...): commit markers, no rename."""

    atomic_rename = False

    def __init__(self, spec: str | dict[str, Any], context: ts.Context):
        if isinstance(spec, str):
            spec = ts.KvStore.Spec(spec if spec.endswith("/") else spec + "/").to_json()
        spec = dict(spec)
        if spec.get("path") and not spec["path"].endswith("/"):
            spec["path"] += "/"
        self._spec = spec
        try:
            self.url = ts.KvStore.Spec(spec).url
        except (ValueError, AttributeError, NotImplementedError):
            self.url = json.dumps(spec, sort_keys=True)
        self._kv = ts.KvStore.open(self._spec, context=context).result()

    def kvstore_spec(self, rel: str) -> dict[str, Any]:
        spec = dict(self._spec)
        rel = safe_relpath(rel)
        spec["path"] = _join(spec.get("path", ""), rel) + "/" if (spec.get("path") or rel) else ""
        return spec

    def _key(self, rel: str) -> str:
        return safe_relpath(rel)

    def _list_prefix(self, prefix: str) -> list[str]:
        if prefix:
            prefix += "/"
        rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + "0") if prefix else ts.KvStore.KeyRange()
        keys = self._kv.list(rng).result()
        return [k.decode("utf-8", "replace")[len(prefix):] for k in keys]

    def list_children(self, rel: str = "") -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self._list_prefix(self._key(rel)) if k})

    def read_bytes(self, rel: str, limit: int) -> bytes | None:
        result = self._kv.read(self._key(rel)).result()
        if result.state != "value":
            return None
        value = bytes(result.value)
        if len(value) > limit:
            raise InvalidMetadataError(
                f"{self.describe(rel)} is {len(value)} bytes, more than the {limit} allowed "
                "for a metadata file.", path=self.describe(rel))
        return value

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._kv.write(self._key(rel), data).result()

    def exists(self, rel: str) -> bool:
        key = self._key(rel)
        if self._kv.read(key).result().state == "value":
            return True
        return bool(self._list_prefix(key))

    def delete_tree(self, rel: str) -> None:
        prefix = self._key(rel)
        if not prefix:
            raise ValueError("refusing to delete the checkpoint root")
        self._kv.delete_range(ts.KvStore.KeyRange(prefix + "/", prefix + "0")).result()
        self._kv.delete_range(ts.KvStore.KeyRange(prefix, prefix + "\x00")).result()


def open_location(directory: str | os.PathLike | dict, context: ts.Context) -> Location:
    """A :class:`Location` for a path, a kvstore URL or a kvstore JSON spec (for options a URL
    cannot carry, e.g. an S3 ``endpoint``); ``file`` kvstores become local directories."""
    if isinstance(directory, os.PathLike):
        return LocalLocation(directory)
    if isinstance(directory, dict):
        if directory.get("driver") == "file":
            return LocalLocation(directory["path"])
        return KvLocation(directory, context)
    if not isinstance(directory, str) or not directory:
        raise TypeError(f"directory must be a path or kvstore URL, got {directory!r}")
    if directory.startswith("file://"):
        return LocalLocation(directory[len("file://"):])
    if "://" in directory:
        return KvLocation(directory, context)
    return LocalLocation(directory)
