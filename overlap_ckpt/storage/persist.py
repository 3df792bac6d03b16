"""The persist protocol of one checkpoint step: data, barriers, merge, metadata, commit.

Why one module: both doors that write (our :class:`~overlap_ckpt.storage.CheckpointStore`
and the Orbax handler, where Orbax commits the step itself) must write an item the same
way, or stock Orbax would read one and not the other. The order is the crash-safety
argument, so it is written once:

1. every process writes its own shards into its own OCDBT database (``write_item``); the
   primary writes ``_METADATA``, the manifest and the step metadata meanwhile (they do not
   depend on the data, and a small file's fsync then overlaps the data's instead of
   following it);
2. barrier ``data``: every process's data is durable;
3. the primary merges the databases into the item root;
4. the primary commits (tmp dir + rename, or a marker written last);
5. barrier ``committed``.

A crash anywhere before 4 leaves an uncommitted directory that readers ignore.
"""

from __future__ import annotations

from typing import Callable, Sequence

import tensorstore as ts

from . import commit, hooks, layout, writer
from .coordination import Coordinator, SingleProcess
from .location import Location
from .tree import Leaf


def write_item(location: Location, item_rel: str, step: int, leaves: Sequence[Leaf],
               arrays: Sequence[writer.ArrayWrite], context: ts.Context, *,
               coordinator: Coordinator = SingleProcess(), batch_bytes: int,
               data_file_size: int | None = None,
               more_metadata: Callable[[], None] = lambda: None) -> None:
    """Steps 1-3: write the item's arrays and metadata into ``item_rel`` (which exists).

    ``more_metadata`` writes the primary's other files of the step while the data is written."""
    if data_file_size is None:
        data_file_size = writer.auto_data_file_size(sum(a.host.nbytes for a in arrays))

    def metadata() -> None:
        if coordinator.is_primary():
            writer.write_item_metadata(location, item_rel, step, leaves, arrays, coordinator.process_count)
            more_metadata()

    writer.write_process_shards(location, item_rel, coordinator.process_index, arrays, context,
                                step=step, batch_bytes=batch_bytes, target_data_file_size=data_file_size,
                                alongside=metadata)
    hooks.fire("data_written", step=step)
    coordinator.barrier(f"overlap_ckpt:{step}:data")
    if coordinator.is_primary():
        writer.merge_into_root(location, item_rel, context)


def persist_step(location: Location, step: int, item_name: str, leaves: Sequence[Leaf],
                 arrays: Sequence[writer.ArrayWrite], step_metadata: dict, context: ts.Context, *,
                 coordinator: Coordinator, batch_bytes: int, data_file_size: int | None = None,
                 on_committed: Callable[[int], None] = lambda step: None) -> None:
    """Steps 1-5 for a whole step directory. Raises on any failure (nothing committed)."""
    work = commit.working_dir(location, step)
    item = f"{work}/{item_name}"
    hooks.fire("start", step=step)
    if coordinator.is_primary():
        commit.delete_incomplete(location, step)  # leftovers of an earlier crashed attempt
        location.make_dir(item)
    coordinator.barrier(f"overlap_ckpt:{step}:created")
    write_item(location, item, step, leaves, arrays, writer.step_context(context),
               coordinator=coordinator, batch_bytes=batch_bytes, data_file_size=data_file_size,
               more_metadata=lambda: location.write_bytes(f"{work}/{layout.STEP_METADATA}",
                                                          layout.dumps(step_metadata)))
    if coordinator.is_primary():
        hooks.fire("metadata_written", step=step)
        hooks.fire("before_commit", step=step)
        commit.commit(location, step)
        on_committed(step)
        hooks.fire("committed", step=step)
    coordinator.barrier(f"overlap_ckpt:{step}:committed")
