"""Exceptions of the storage layer: one class per fault, each message says what and how to fix.

Why one class per fault: a training loop reacts differently to "the disk is full" (free
space, keep training, the next save retries) than to "the checkpoint you asked for is
corrupt" (fall back to an earlier step) or "someone else owns this directory" (a
configuration error). Every class derives from :class:`CheckpointError`, itself an
:class:`overlap_ckpt.errors.OverlapCkptError`, so one ``except`` can still catch them all.
"""

from __future__ import annotations

import errno as _errno

from ..errors import CheckpointError, TreeMismatchError


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The directory holds no complete checkpoint, or not the requested step."""


class IncompleteCheckpointError(CheckpointError):
    """The requested step exists only partially (a crash or a save still in progress)."""


class CorruptCheckpointError(CheckpointError):
    """Bytes or metadata on disk are not what was written (checksum, bad JSON, bad spec)."""


class CorruptChunkError(CorruptCheckpointError):
    """A chunk's stored crc32c does not match its bytes (bit rot, truncated copy, tampering)."""

    def __init__(self, message: str, *, array: str | None = None, chunk: str | None = None, **kw):
        super().__init__(message, **kw)
        self.array = array
        self.chunk = chunk


class InvalidMetadataError(CorruptCheckpointError):
    """A metadata file is malformed, inconsistent, or names a path outside the checkpoint."""


class MissingArrayError(CheckpointError):
    """An array listed in the checkpoint's tree metadata (or one of its chunks) is absent."""

    def __init__(self, message: str, *, array: str | None = None, **kw):
        super().__init__(message, **kw)
        self.array = array


class TargetMismatchError(CheckpointError, TreeMismatchError):
    """The restore target differs from the saved tree (structure, shape or dtype)."""


class CheckpointWriteError(CheckpointError):
    """Persisting a step failed (I/O error). The partial step was removed; earlier steps are intact."""

    def __init__(self, message: str, *, errno: int | None = None, **kw):
        super().__init__(message, **kw)
        self.errno = errno


class OutOfSpaceError(CheckpointWriteError):
    """The filesystem or quota is full (ENOSPC / EDQUOT)."""


class CheckpointLockedError(CheckpointError):
    """Another live CheckpointStore owns this directory."""


class StepAlreadyExistsError(CheckpointError, ValueError):
    """``save`` was asked for a step that is already committed or already queued."""


class StoreClosedError(CheckpointError, RuntimeError):
    """The store was used after :meth:`CheckpointStore.close`."""


# -- classifying low-level errors ---------------------------------------------------------

# TensorStore reports OS errors inside ValueError messages ("[OS error 28: No space left
# on device]"); match both the errno form and the strerror text.
_ERRNO_TEXT = {
    _errno.ENOSPC: ("No space left on device", "OS error 28", "RESOURCE_EXHAUSTED"),
    _errno.EDQUOT: ("Disk quota exceeded", "OS error 122"),
    _errno.EIO: ("Input/output error", "OS error 5:"),
    _errno.EFBIG: ("File too large", "OS error 27"),
    _errno.EROFS: ("Read-only file system", "OS error 30"),
    _errno.EACCES: ("Permission denied", "OS error 13"),
}

_FIXES = {
    _errno.ENOSPC: "free space on the checkpoint filesystem (or lower max_to_keep)",
    _errno.EDQUOT: "raise the quota or lower max_to_keep",
    _errno.EIO: "check the storage device / network filesystem health",
    _errno.EFBIG: "raise the file size limit (ulimit -f) or use a filesystem that allows larger files",
    _errno.EROFS: "point the store at a writable directory",
    _errno.EACCES: "fix the permissions of the checkpoint directory",
}


def errno_of(exc: BaseException) -> int | None:
    """Best-effort errno of ``exc`` or of the error chain it wraps (TensorStore text included)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        text = str(exc)
        for code, needles in _ERRNO_TEXT.items():
            if any(n in text for n in needles):
                return code
        exc = exc.__cause__ or exc.__context__
    return None


def write_error(exc: BaseException, *, step: int, path: str,
                partial_removed: bool = True) -> CheckpointWriteError:
    """Wrap a failure of the persist of ``step`` in the right :class:`CheckpointWriteError`.

    ``partial_removed`` says whether the partial step is already gone: when the storage
    itself went away, its removal fails too and is left to the next save (readers never
    see it either way: it has no commit)."""
    if isinstance(exc, CheckpointWriteError):
        return exc
    code = errno_of(exc)
    fix = _FIXES.get(code, "check the storage and the log above")
    name = _errno.errorcode.get(code, "I/O error") if code else type(exc).__name__
    partial = ("The partial step was removed" if partial_removed else
               "The partial step is not committed (readers ignore it) and the next save removes it")
    message = (f"Persisting checkpoint step {step} to {path} failed ({name}): {exc}. "
               f"{partial}; earlier steps are untouched; "
               f"{fix}, then call save() again (training can continue).")
    cls = OutOfSpaceError if code in (_errno.ENOSPC, _errno.EDQUOT) else CheckpointWriteError
    err = cls(message, errno=code, step=step, path=path)
    err.__cause__ = exc
    return err


def read_error(exc: BaseException, *, step: int | None, path: str, array: str) -> CheckpointError:
    """Translate a TensorStore read/open failure of ``array`` into a storage error.

    The status code decides (``DATA_LOSS`` damaged bytes, ``OUT_OF_RANGE`` a truncated file,
    ``NOT_FOUND`` deleted data), never words of the message: TensorStore messages embed the
    whole spec, whose option names would otherwise turn a damaged file into "missing"."""
    if isinstance(exc, CheckpointError):
        return exc
    text = str(exc)
    where = f"array {array!r} of step {step} in {path}"
    if "Digest mismatch" in text or "crc32c" in text.lower() and "mismatch" in text:
        chunk = _quoted_key(text)
        err: CheckpointError = CorruptChunkError(
            f"Checksum mismatch in chunk {chunk or '?'} of {where}: the stored bytes changed "
            f"after they were written (disk corruption or a damaged copy). Restore an earlier "
            f"step (store.all_steps()) or re-copy the checkpoint. Details: {text}",
            array=array, chunk=chunk, step=step, path=path)
    elif text.startswith("OUT_OF_RANGE"):
        err = CorruptCheckpointError(
            f"A data file of {where} is shorter than its index says (truncated copy or disk "
            f"corruption): {text}. Restore an earlier step or re-copy the checkpoint.",
            step=step, path=path)
    elif text.startswith("DATA_LOSS") or text.startswith("FAILED_PRECONDITION"):
        err = CorruptCheckpointError(
            f"Unreadable data for {where}: {text}. Restore an earlier step or re-copy the "
            f"checkpoint.", step=step, path=path)
    elif text.startswith("NOT_FOUND") or "does not exist" in text:
        err = MissingArrayError(
            f"Missing data for {where}: {text}. The checkpoint was copied incompletely or "
            f"files were deleted; restore another step or re-copy the directory.",
            array=array, step=step, path=path)
    else:
        err = CheckpointError(f"Reading {where} failed: {text}", step=step, path=path)
    err.__cause__ = exc
    return err


def _quoted_key(text: str) -> str | None:
    """The first double-quoted key in a TensorStore message, e.g. ``"a/c/0/0"``."""
    start = text.find('"')
    end = text.find('"', start + 1) if start >= 0 else -1
    return text[start + 1:end] if end > start else None
