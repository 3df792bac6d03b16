"""Exceptions raised by overlap_ckpt, one class per kind of fault so callers can react."""

import dataclasses
import importlib.metadata


class OverlapCkptError(Exception):
    """Base class of every error raised by overlap_ckpt."""


class UnsupportedOptimizerError(OverlapCkptError, ValueError):
    """The optax transformation cannot be replayed exactly on slices of the state."""


class InternalError(OverlapCkptError, RuntimeError):
    """overlap_ckpt itself failed: a bug of ours, or a dependency older than we need.

    Kept apart from the refusals (:class:`UnsupportedOptimizerError`, ...) because those
    tell the user to change their code; a missing JAX API reported as "your optimizer is
    not supported" sends them to change an optimizer that is fine. Not a ``ValueError``,
    so code that catches bad-input errors does not swallow it.
    """


def internal_error(doing: str, cause: BaseException) -> InternalError:
    """The :class:`InternalError` for ``cause``, raised while ``doing`` something of ours,
    naming the installed versions (the usual cause is a dependency below our floor)."""
    return InternalError(
        f"overlap_ckpt failed while {doing} ({type(cause).__name__}: {brief(cause)}). This is "
        f"not a fault of your optimizer or model. Installed: {_versions()}. Install the "
        "dependency versions overlap_ckpt's pyproject.toml requires; if they are installed, "
        "this is a bug of overlap_ckpt: please report it with this traceback.")


def _versions() -> str:
    found = []
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "numpy"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


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


@dataclasses.dataclass(frozen=True)
class CheckpointFailure:
    """One checkpoint that was not written: its step, the stage that failed, the cause.

    The engine records the "window" (a window discarded, see
    :class:`~overlap_ckpt.errors.WindowAborted`), "replay" and "handoff" stages, the storage
    the "persist" one;
    :class:`overlap_ckpt.CheckpointManager` keeps them all in ``failed_steps()``.
    """

    step: int | None
    stage: str  # "window", "replay", "handoff", "persist"
    error: BaseException

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step is not None else "a step"
        return f"{where} failed in {self.stage}: {type(self.error).__name__}: {brief(self.error)}"


def brief(error: BaseException, limit: int = 300) -> str:
    """``error``'s message on one line, cut at ``limit`` characters: XLA and tracer messages
    run to pages, and a log line or a wrapping error needs only their start."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + "..."
