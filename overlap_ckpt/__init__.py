"""overlap_ckpt: multi-step overlapped, gradient-assisted checkpointing for JAX training.

The train state is captured in K slices over K steps inside the jitted step, the optimizer
is replayed on the host so every slice reaches the same version, and the result is
persisted in the background in a layout stock Orbax can read.
"""

from .capture import capture_update
from .engine import MemorySink, OverlapEngine
from .errors import (ConfigError, OverlapCkptError, TreeMismatchError, UnsupportedOptimizerError,
                     WindowAborted)
from .hostarray import HostArray, HostShard
from .plan import CapturePlan, make_plan
from .schedule import WindowSchedule
from .flax_linen import TrainState
from .manager import CheckpointManager
from . import nnx_optimizer as nnx

__all__ = [
    "capture_update", "MemorySink", "OverlapEngine", "ConfigError", "OverlapCkptError",
    "TreeMismatchError", "UnsupportedOptimizerError", "WindowAborted", "HostArray", "HostShard",
    "CapturePlan", "make_plan", "WindowSchedule", "TrainState", "CheckpointManager", "nnx",
]
__version__ = "0.1.0"

# The Orbax door and the storage layer import orbax/tensorstore (~0.6 s): loaded on first use.
_LAZY = {"HostCopySink": "orbax_handler", "OverlapCheckpointHandler": "orbax_handler",
         "OverlapSave": "orbax_handler", "overlap_handler_registry": "orbax_handler",
         "orbax_handler": None, "storage": None}
__all__ += list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value
