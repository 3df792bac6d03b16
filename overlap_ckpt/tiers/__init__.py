"""The local tier: checkpoints every few steps to node-local storage, beside the durable ones.

* :mod:`~overlap_ckpt.tiers.config` — :class:`LocalTier`, the user's configuration;
* :mod:`~overlap_ckpt.tiers.store` — :class:`TieredStore`, both tiers behind the store contract;
* :mod:`~overlap_ckpt.tiers.peers` — peer replicas of a process's local steps;
* :mod:`~overlap_ckpt.tiers.transport` — the bulk transport those replicas travel over;
* :mod:`~overlap_ckpt.tiers.restore` — reading a local step back into a job's layout.
"""

from .config import LocalTier

__all__ = ["LocalTier", "TieredStore"]


def __getattr__(name: str):
    # The store imports the storage layer (orbax, tensorstore: ~0.6 s); the configuration does not.
    if name == "TieredStore":
        from .store import TieredStore
        return TieredStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
