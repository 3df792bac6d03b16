"""Exceptions raised by overlap_ckpt, one class per kind of fault so callers can react."""


class OverlapCkptError(Exception):
    """Base class of every error raised by overlap_ckpt."""


class UnsupportedOptimizerError(OverlapCkptError, ValueError):
    """The optax transformation cannot be replayed exactly on slices of the state."""


class TreeMismatchError(OverlapCkptError, ValueError):
    """A train state's structure, shapes or dtypes differ from what was planned or saved."""


class WindowAborted(OverlapCkptError):
    """A checkpoint window could not complete; nothing of it was handed to storage."""


class ConfigError(OverlapCkptError, ValueError):
    """An option is out of range or inconsistent with another one."""


class CheckpointError(OverlapCkptError):
    """A checkpoint could not be written or read. ``step`` and ``path`` name where, when known.

    The storage layer raises subclasses, one per fault (:mod:`overlap_ckpt.storage.errors`);
    :class:`overlap_ckpt.CheckpointManager` raises this class itself for failed background
    checkpoints, with every failure in ``failures`` and the first cause chained.
    """

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None,
                 failures: tuple = ()):
        super().__init__(message)
        self.step = step
        self.path = path
        self.failures = failures
