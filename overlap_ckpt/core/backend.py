"""Which backend's rules a device follows.

The capture isolates the update with an optimization barrier on GPU/TPU and with a
conditional on the CPU backend (see :func:`overlap_ckpt.core.capture.isolated`), and
``window="auto"`` keeps K=1 on the CPU backend. Those decisions read the platform here, so
that :func:`overlap_ckpt.testing.emulate_accelerator` can run the accelerator branches on
the CPU in CI. Nothing else should set :data:`emulated`. :func:`replay_device` is where windows of K > 1
are replayed: the CPU backend, which ``JAX_PLATFORMS`` can leave out.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from ..errors import ConfigError

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


def replay_device() -> Any:
    """This process's CPU device, where the host replay of a window of K > 1 runs.

    Why a check of its own: JAX initializes only the backends ``JAX_PLATFORMS`` names, and
    ``JAX_PLATFORMS=cuda`` (or ``tpu``), common on accelerator machines, leaves the CPU
    out. Without this, the refusal read "cannot replay this optimizer", which sends the
    user to change an optimizer that is fine.
    """
    try:
        return jax.local_devices(backend="cpu")[0]  # this process's (multi-process CPU jobs)
    except RuntimeError as e:
        raise ConfigError(
            f"a window of K > 1 steps replays the optimizer on this host with JAX's CPU backend, "
            f"which this process did not initialize ({e}; JAX_PLATFORMS="
            f"{os.environ.get('JAX_PLATFORMS', '')!r}). Add cpu to JAX_PLATFORMS (for example "
            f"JAX_PLATFORMS=cuda,cpu) or leave it unset; or use window=1, which replays nothing.") from e

