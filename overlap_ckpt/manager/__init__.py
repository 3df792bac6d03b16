"""``CheckpointManager``: the Orbax-like front door of overlapped checkpointing, and the
policies it composes.

One object owns the storage (a :class:`~overlap_ckpt.storage.protocol.Store`), the overlap
engine (:class:`overlap_ckpt.core.engine.OverlapEngine`) and the door of the loop's state
style (:mod:`overlap_ckpt.doors`). The training loop calls ``CheckpointManager.step`` once
per step, after its jitted step. Outside checkpoint windows that call returns the state it
was given and the step is the user's own program; in a window the manager takes the step's
outbox, hands it to the engine and gives the next step its window ticket. It never waits on
the device: the step number is read once (``prepare``) and counted on the host afterwards.

Failures of background work (a replay, a write, a full disk) are raised as
:class:`overlap_ckpt.errors.CheckpointError` from the next ``step`` or ``save``
(``on_error="raise"``, the default, like Orbax's async saves) or logged (``on_error="log"``);
either way every failed step is kept in ``failed_steps``.

One module per concern, the manager itself (:mod:`~overlap_ckpt.manager.manager`: the
per-step API, saves and restores, queries, lifetime) composing the others:

* :mod:`~overlap_ckpt.manager.options` — its settings, checked before anything opens;
* :mod:`~overlap_ckpt.manager.handoff` — the ticket out, the outbox back, every step;
* :mod:`~overlap_ckpt.manager.window_choice` — ``window="auto"``;
* :mod:`~overlap_ckpt.manager.compile_ahead` — window variants compiled in the background;
* :mod:`~overlap_ckpt.manager.copy_schedule` — the GPU copy-schedule hint (opt-in);
* :mod:`~overlap_ckpt.manager.aot_report` — the step checked for a target, compile-only, in one call;
* :mod:`~overlap_ckpt.manager.host_budget` — admitting a window under ``max_host_bytes``;
* :mod:`~overlap_ckpt.manager.save_tree` — the app's own arrangement of the saved tree;
* :mod:`~overlap_ckpt.manager.failures` — background failures, reported at the next call;
* :mod:`~overlap_ckpt.manager.preemption` — draining checkpoints on SIGTERM.
"""

from ..errors import CheckpointFailure
from .manager import CheckpointManager

__all__ = ["CheckpointManager", "CheckpointFailure"]
