"""A second way in, beside :class:`overlap_ckpt.CheckpointManager`: an Orbax checkpoint
handler, for a team that keeps its own ``orbax.checkpoint.CheckpointManager``.

Not a door (:mod:`overlap_ckpt.doors` tell the manager where a loop style keeps its state):
here Orbax's manager drives saving, and overlap_ckpt supplies the consistent host copy and
writes it in Orbax's layout (:mod:`~overlap_ckpt.orbax_handler.handler`).
"""

from .handler import HostCopySink, OverlapCheckpointHandler, OverlapSave, overlap_handler_registry

__all__ = ["HostCopySink", "OverlapCheckpointHandler", "OverlapSave", "overlap_handler_registry"]
