"""The manager's settings, checked when they are made, and the store they open.

Why apart from the manager: as Orbax's ``CheckpointManagerOptions`` does in its
``__post_init__``, a bad setting is refused with its fix before a directory is opened or a
step runs, and the manager keeps only the per-step protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import ConfigError
from ..tiers import LocalTier


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """The keyword arguments of :class:`~overlap_ckpt.CheckpointManager` that shape its
    checkpoints (documented there); the host budget checks its own two."""

    save_interval_steps: int | None = None
    max_to_keep: int | None = None
    keep_every_n_steps: int | None = None
    window: int | str = "auto"
    item_name: str = "default"
    on_error: str = "raise"
    persist_bytes_per_s: float = 1e9
    local: LocalTier | None = None

    def __post_init__(self) -> None:
        interval = self.save_interval_steps
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ConfigError(f"save_interval_steps must be an int >= 1 (or None to only restore), "
                              f"got {interval!r}")
        window = self.window
        if window != "auto" and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"window must be 'auto' or an int >= 1, got {window!r}")
        if self.on_error not in ("raise", "log"):
            raise ConfigError(f"on_error must be 'raise' or 'log', got {self.on_error!r}")
        if self.local is not None:
            if not isinstance(self.local, LocalTier):
                raise ConfigError(f"local must be an overlap_ckpt.LocalTier, got {type(self.local).__name__}")
            self.local.check_interval(interval)

    def check_writable(self, what: str) -> None:
        """Refuse ``CheckpointManager.<what>`` on a manager opened to restore only."""
        if self.save_interval_steps is None:
            raise ConfigError(f"CheckpointManager.{what}: this manager was opened without "
                              "save_interval_steps, for restoring only; pass save_interval_steps= to train.")

    @property
    def capture_interval(self) -> int | None:
        """Steps between windows: the local tier's interval where there is one (the tiered
        store routes the durable steps onward), else the save interval."""
        if self.local is not None and self.save_interval_steps:
            return self.local.every
        return self.save_interval_steps

    def open_store(self, directory: Any, store: Any = None) -> Any:
        """``store`` (already open) or a :class:`~overlap_ckpt.storage.CheckpointStore` on
        ``directory``, behind a :class:`~overlap_ckpt.tiers.store.TieredStore` with a local tier."""
        if store is None:
            if directory is None:
                raise ConfigError("CheckpointManager needs a directory (or store=)")
            from ..storage import CheckpointStore
            store = CheckpointStore(directory, max_to_keep=self.max_to_keep,
                                    keep_every_n_steps=self.keep_every_n_steps, item_name=self.item_name,
                                    read_only=self.save_interval_steps is None)
        if self.local is None:
            return store
        from ..tiers.store import TieredStore
        try:
            return TieredStore(store, self.local, self.save_interval_steps)
        except BaseException:
            store.close()
            raise
