"""overlap_ckpt: multi-step overlapped, gradient-assisted checkpointing for JAX training.

The train state is captured in K slices over K steps inside the jitted step, the optimizer
is replayed on the host so every slice reaches the same version, and the result is
persisted in the background in a layout stock Orbax can read.

Layout of the package, one folder per concept, each importing only the floors below it
(written as import-linter contracts in ``.importlinter``; docs/design.md draws it):

* :mod:`overlap_ckpt.tools` — the ``overlap-ckpt`` command, the demo, its models, and the
  ``overlap-ckpt aot`` benchmark and report;
* :mod:`overlap_ckpt.manager` — the Orbax-like front door and one module per policy it
  composes; :mod:`overlap_ckpt.orbax_handler` — the other way in, through your own Orbax
  ``CheckpointManager``;
* :mod:`overlap_ckpt.aot` — window programs compiled for an H100 or a TPU slice without one,
  and the stall they predict;
* :mod:`overlap_ckpt.doors` — how a training loop style reaches the engine (Flax Linen
  ``TrainState``, NNX ``Optimizer``); :mod:`overlap_ckpt.tiers` — the node-local tier and its
  peer replicas; :mod:`overlap_ckpt.costmodel` — the cost model, the choice of K, hardware
  figures;
* :mod:`overlap_ckpt.core` — framework-free algorithm: plan, capture, host replay, engine;
  :mod:`overlap_ckpt.storage` — persist, commit, restore, verify (Orbax's on-disk layout);
* the ground floor: :mod:`overlap_ckpt.errors`, :mod:`overlap_ckpt.hostarray`,
  :mod:`overlap_ckpt.gil`; and :mod:`overlap_ckpt.testing` (test-only switches).
"""

from . import _moved
from .core.capture import capture_update
from .core.engine import MemorySink, OverlapEngine
from .errors import (ConfigError, InternalError, OverlapCkptError, TreeMismatchError,
                     UnsupportedOptimizerError, WindowAborted)
from .hostarray import HostArray, HostShard
from .doors.linen import TrainState
from .manager import CheckpointManager
from .tiers import LocalTier

_moved.install()  # old module paths (overlap_ckpt.autok, ...) keep importing for a release

__all__ = [
    "capture_update", "MemorySink", "OverlapEngine", "ConfigError", "InternalError", "OverlapCkptError",
    "TreeMismatchError", "UnsupportedOptimizerError", "WindowAborted", "HostArray", "HostShard",
    "TrainState", "CheckpointManager", "LocalTier",
]
__version__ = "0.1.0"

# Loaded on first use: the Orbax door and the storage layer import orbax and tensorstore
# (~0.6 s), the NNX door flax.nnx (~1 s, which a Linen or Orbax loop never needs).
# Each name: (module, attribute of it, or None for the module itself).
_LAZY = {**{name: ("orbax_handler", name) for name in ("HostCopySink", "OverlapCheckpointHandler", "OverlapSave",
                                                     "overlap_handler_registry")},
         "storage": ("storage", None), "aot": ("aot", None), "nnx": ("doors.nnx", None),
         "preemption": ("manager.preemption", None)}
__all__ += list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    path, attribute = _LAZY[name]
    module = importlib.import_module(f".{path}", __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value
