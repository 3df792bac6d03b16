"""Which backend's rules a device follows.

The capture isolates the update with an optimization barrier on GPU/TPU and with a
conditional on the CPU backend (see :func:`overlap_ckpt.core.capture.isolated`), and
``window="auto"`` keeps K=1 on the CPU backend. Those decisions read the platform here, so
that :func:`overlap_ckpt.testing.emulate_accelerator` can run the accelerator branches on
the CPU in CI. Nothing else should set :data:`emulated`.
"""

from __future__ import annotations

from typing import Any

emulated: str | None = None  # set by overlap_ckpt.testing only
emulated_memory: str | None = None  # likewise: the memory kind window copies go to

HOST_MEMORY = "host"  # "the backend's host memory for window copies", resolved below


def platform_of(device: Any) -> str:
    return emulated or device.platform


def outbox_memory(requested: str | None) -> str | None:
    """The memory kind window copies go to: ``pinned_host`` for :data:`HOST_MEMORY` (so XLA
    copies asynchronously), ``None`` to leave them in device memory (``jax.pmap``)."""
    if requested == HOST_MEMORY:
        return emulated_memory or "pinned_host"
    return requested
