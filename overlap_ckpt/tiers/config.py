"""The user's configuration of the local tier (:class:`LocalTier`), checked when it is made.

Apart from the store it configures so that ``overlap_ckpt.LocalTier`` imports nothing of the
storage layer: a job builds it before anything is opened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile

from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """Configuration of the local tier of a :class:`~overlap_ckpt.CheckpointManager`.

    Args:
      path: node-local directory (tmpfs for memory speed). ``None``: a directory under
        ``/dev/shm`` named after the durable directory, so a restarted job finds it.
      every: write the consistent host copy here every ``every`` steps; the manager's
        ``save_interval_steps`` must be a multiple of it (the durable steps are a subset).
      max_to_keep: local steps kept (each holds a full copy of this process's shards in
        node memory when ``path`` is on tmpfs), and replica steps kept per peer.
      replicas: with N processes, each process also holds the local steps of this many
        peers (``0 < replicas < N``), so that the local tier survives the loss of up to
        ``replicas`` consecutive hosts (:mod:`overlap_ckpt.tiers.peers`); each costs one more copy
        of a process's shards per kept step in node memory.
    """

    path: str | os.PathLike | None = None
    every: int = 10
    max_to_keep: int = 2
    replicas: int = 0

    def __post_init__(self) -> None:
        for name, least in (("every", 1), ("max_to_keep", 1), ("replicas", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"LocalTier.{name} must be an int >= {least}, got {value!r}")
        if self.path is not None and (not isinstance(self.path, (str, os.PathLike))
                                      or "://" in os.fspath(self.path)):
            raise ConfigError(f"LocalTier.path must be a node-local directory path, got {self.path!r}; "
                              "object stores belong in the durable directory")

    def check_processes(self, process_count: int) -> None:
        """Replicas live on other processes: each needs a distinct peer."""
        if self.replicas >= max(process_count, 1) or (self.replicas and process_count < 2):
            raise ConfigError(
                f"LocalTier(replicas={self.replicas}) needs more than {self.replicas} processes, but this "
                f"job has {process_count}: pass replicas <= {max(process_count - 1, 0)} (each replica is "
                "held by another process, through jax.distributed; call jax.distributed.initialize first)")

    def check_interval(self, save_interval_steps: int | None) -> None:
        if save_interval_steps is not None and save_interval_steps % self.every:
            raise ConfigError(f"save_interval_steps={save_interval_steps} must be a multiple of "
                              f"LocalTier.every={self.every}: every durable checkpoint is also a local one")

    def directory(self, durable_url: str, process_index: int, process_count: int) -> str:
        """This process's local directory."""
        if self.path is not None:
            root = os.fspath(self.path)
        else:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            root = os.path.join(base, "overlap_ckpt", hashlib.sha1(durable_url.encode()).hexdigest()[:16])
        return root if process_count <= 1 else os.path.join(root, f"process_{process_index}")
