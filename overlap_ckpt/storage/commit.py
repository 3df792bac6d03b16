"""Atomic commit and crash-safe deletion of steps.

Invariant: a step directory that *looks* complete (final name on POSIX, commit marker on
object stores) is complete. Hence:

* **POSIX**: everything is written under ``<step>.orbax-checkpoint-tmp/``; all files are
  fsync'd (TensorStore fsyncs its files, :class:`LocalLocation` ours), then every directory
  of the tree, then ``commit_success.txt`` is written and the directory is renamed to
  ``<step>/`` (atomic), and the root directory is fsync'd so the rename survives power
  loss. A crash before the rename leaves only a tmp directory, invisible to readers.
* **Object stores** (no rename): data and metadata are written in ``<step>/`` and the
  ``commit_success.txt`` marker is written strictly last; readers ignore a step without it.
* **Deletion** runs the protocol backwards: on POSIX the step is first renamed to a tmp
  name (so a crash mid-``rmtree`` never leaves a half-deleted ``<step>/``), on object
  stores the marker is deleted first.
"""

from __future__ import annotations

import dataclasses
import re
import time

from . import layout
from .location import Location


@dataclasses.dataclass(frozen=True)
class StepListing:
    complete: list[int]
    incomplete: list[int]


def working_dir(location: Location, step: int) -> str:
    """Where a step is written before its commit."""
    return layout.tmp_dir(step) if location.atomic_rename else layout.step_dir(step)


def list_steps(location: Location) -> StepListing:
    """Committed and partial steps under the root (one directory listing, plus one marker
    lookup per step on object stores)."""
    complete, incomplete = set(), set()
    for name in location.list_children(""):
        parsed = layout.parse_step_name(name)
        if parsed is None:
            continue
        step, final = parsed
        if not final:
            incomplete.add(step)
        elif location.atomic_rename:
            if location.is_dir(name):
                complete.add(step)
        elif location.exists(f"{name}/{layout.COMMIT_MARKER}"):
            complete.add(step)
        else:
            incomplete.add(step)
    return StepListing(sorted(complete), sorted(incomplete - complete))


# Names other checkpointers give their steps: Flax's checkpoints.save_checkpoint
# ("checkpoint_1000"), common hand-rolled ones ("ckpt-1000", "step_1000.pkl", "model_1000.msgpack").
_FOREIGN = re.compile(r"^(checkpoint|ckpt|step|model|state)[_-]?\d+(\.[A-Za-z0-9]+)?$")


def foreign_checkpoints(location: Location) -> list[str]:
    """Entries under the root that look like another format's checkpoints, sorted."""
    return sorted(name for name in location.list_children("")
                  if layout.parse_step_name(name) is None and _FOREIGN.match(name))


def commit(location: Location, step: int) -> None:
    """Make the fully written step ``step`` visible, atomically (see module docstring)."""
    work = working_dir(location, step)
    marker = f"Checkpoint commit was successful to {location.describe(layout.step_dir(step))}"
    location.write_bytes(f"{work}/{layout.COMMIT_MARKER}", marker.encode())
    if location.atomic_rename:
        location.sync_tree(work)
        location.rename(work, layout.step_dir(step))


def delete_step(location: Location, step: int) -> None:
    """Delete a committed step so that no crash point leaves it looking complete."""
    name = layout.step_dir(step)
    if location.atomic_rename:
        doomed = f"{step}{layout.DELETING_SUFFIX}"
        location.delete_tree(doomed)
        location.rename(name, doomed)
        location.delete_tree(doomed)
    else:
        location.delete_tree(f"{name}/{layout.COMMIT_MARKER}")
        location.delete_tree(name)


def delete_incomplete(location: Location, step: int) -> None:
    """Remove every partial leftover of ``step`` (never a committed ``<step>/`` on POSIX)."""
    for name in location.list_children(""):
        parsed = layout.parse_step_name(name)
        if parsed is None or parsed[0] != step:
            continue
        if parsed[1] and location.atomic_rename:
            continue  # final name on POSIX = committed: never touched here
        if parsed[1] and location.exists(f"{name}/{layout.COMMIT_MARKER}"):
            continue
        location.delete_tree(name)


# A failed step's leftovers must stay gone this long before they count as removed (see
# delete_failed), polled this often, for at most FAILED_STEP_TIMEOUT_S.
FAILED_STEP_QUIET_S = 0.25
FAILED_STEP_POLL_S = 0.02
FAILED_STEP_TIMEOUT_S = 10.0


def delete_failed(location: Location, step: int) -> bool:
    """Remove the leftovers of a step whose persist just failed; True once they stay gone.

    Why not :func:`delete_incomplete` once: OCDBT writes a commit's data files in parallel
    and fails the commit at the first error, while the other writes run on; one that starts
    after the deletion recreates the step's directory (tensorstore makes missing parents),
    and the step is listed as partial again although the error said it was removed (3 of 40
    runs of a full tmpfs). tensorstore gives no handle on those writes, so the leftovers are
    removed again whenever they reappear, until none has for :data:`FAILED_STEP_QUIET_S`.
    """
    delete_incomplete(location, step)
    now = time.monotonic()
    quiet_until, deadline = now + FAILED_STEP_QUIET_S, now + FAILED_STEP_TIMEOUT_S
    while time.monotonic() < min(quiet_until, deadline):
        time.sleep(FAILED_STEP_POLL_S)
        if step in list_steps(location).incomplete:
            delete_incomplete(location, step)
            quiet_until = time.monotonic() + FAILED_STEP_QUIET_S
    return step not in list_steps(location).incomplete
