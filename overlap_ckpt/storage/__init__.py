"""Storage layer: persist host copies of a train state in the background, restore, verify.

The on-disk format is Orbax's (``CheckpointManager`` + ``StandardSave`` with OCDBT and
zarr3), so stock Orbax restores our checkpoints and we restore Orbax's; see
``docs/format.md``. Quick use::

    from overlap_ckpt.storage import CheckpointStore

    with CheckpointStore("/ckpt", max_to_keep=3) as store:
        store.save(step, host_tree, {"data_position": pos})   # returns at once
        ...
        tree, meta = store.restore(target=abstract_state)     # resharded onto the target
"""

from .errors import (CheckpointError, CheckpointLockedError, CheckpointNotFoundError,
                     CheckpointWriteError, CorruptCheckpointError, CorruptChunkError,
                     IncompleteCheckpointError, InvalidMetadataError, MissingArrayError,
                     OutOfSpaceError, StepAlreadyExistsError, StoreClosedError, TargetMismatchError)
from .hooks import STAGES as FAULT_STAGES
from .hooks import set_fault_hook
from .coordination import Coordinator, SingleProcess
from .store import CheckpointStore, PersistRecord
from .verify import StepCheck, VerifyReport

__all__ = [
    "CheckpointStore", "Coordinator", "SingleProcess", "PersistRecord", "VerifyReport", "StepCheck",
    "set_fault_hook", "FAULT_STAGES",
    "CheckpointError", "CheckpointLockedError", "CheckpointNotFoundError", "CheckpointWriteError",
    "CorruptCheckpointError", "CorruptChunkError", "IncompleteCheckpointError",
    "InvalidMetadataError", "MissingArrayError", "OutOfSpaceError", "StepAlreadyExistsError",
    "StoreClosedError", "TargetMismatchError",
]
