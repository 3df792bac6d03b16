"""Damage done to a committed step after the fact, and what restoring it must then do.

Shared by tests/faults/test_corruption_and_hardening.py (one damage per test, on step 12)
and the random-fault soak (a random damage on a random committed step), so that both hold
the library to the same promise of docs/troubleshooting.md: damaged data or OCDBT metadata
makes restore raise exactly the class below, naming the step; optional files and stray tmp
dirs are harmless (the step restores exactly).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from overlap_ckpt.storage import CorruptCheckpointError, MissingArrayError


def data_files(root: Path, step: int) -> list[Path]:
    # Small chunks are inlined in the b-tree nodes of the merged root (default/d).
    item = Path(root) / str(step) / "default"
    return sorted([*(item / "d").iterdir(), *(item / "ocdbt.process_0" / "d").iterdir()],
                  key=lambda p: p.stat().st_size)


def flip_byte(root, step: int = 12):
    for f in data_files(root, step):  # every data file: one of them holds the chunks read
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        f.write_bytes(bytes(raw))


def truncate_chunk_file(root, step: int = 12):
    for f in data_files(root, step):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def delete_tree_metadata(root, step: int = 12):
    (Path(root) / str(step) / "default" / "_METADATA").unlink()


def delete_ocdbt_manifest(root, step: int = 12):
    (Path(root) / str(step) / "default" / "manifest.ocdbt").unlink()


def delete_step_metadata(root, step: int = 12):
    (Path(root) / str(step) / "_CHECKPOINT_METADATA").unlink()  # optional file: restore still exact


def stray_tmp_dir(root, step: int = 12):
    """A copy of ``step`` left as the tmp dir of a later step (a writer killed mid-persist)."""
    root = Path(root)
    stray = root / f"{step + 4}.orbax-checkpoint-tmp"
    if stray.exists():
        shutil.rmtree(stray)
    shutil.copytree(root / str(step), stray)
    (stray / "junk").write_bytes(os.urandom(100))


# damage -> what restoring the step must do: raise exactly this class, or (None) restore exactly.
# The test state is small, so chunks are inlined in the OCDBT B-tree nodes: the "data files"
# damaged here are those nodes (tests/storage/test_faults.py flips bytes of chunk files).
DAMAGE = {"flipped byte in every data file": (flip_byte, CorruptCheckpointError),
          "truncated data files": (truncate_chunk_file, CorruptCheckpointError),
          "deleted _METADATA of the latest step": (delete_tree_metadata, CorruptCheckpointError),
          "deleted manifest.ocdbt of the latest step": (delete_ocdbt_manifest, MissingArrayError),
          "deleted _CHECKPOINT_METADATA (optional)": (delete_step_metadata, None),
          "stray *.orbax-checkpoint-tmp dir": (stray_tmp_dir, None)}
