"""Offline verification: every chunk of every array is read and its crc32c checked.

Why: a checkpoint is only useful if it restores. ``verify`` reads each step exactly as a
restore would (same metadata validation, same TensorStore reads with checksums and no
fill-value substitution for missing chunks) without keeping the data. When an array
fails, it is re-read chunk by chunk so the report names the damaged chunks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import tensorstore as ts

from . import layout
from .errors import CheckpointError, read_error
from .location import Location
from .restore import PendingRead, bounded, open_arrays, open_step, stored_nbytes


@dataclasses.dataclass
class StepCheck:
    """Result for one step. ``checksummed`` is False for arrays written without crc32c
    (e.g. by stock Orbax): their bytes were read but cannot be checked."""

    step: int
    ok: bool = True
    arrays: int = 0
    chunks: int = 0
    bytes: int = 0
    checksummed: bool = True
    problems: list[str] = dataclasses.field(default_factory=list)
    errors: list[CheckpointError] = dataclasses.field(default_factory=list, repr=False)

    def fail(self, err: CheckpointError) -> None:
        self.ok = False
        self.errors.append(err)
        self.problems.append(str(err))


@dataclasses.dataclass
class VerifyReport:
    """Outcome of :meth:`CheckpointStore.verify`."""

    steps: dict[int, StepCheck]
    incomplete_steps: list[int]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps.values())

    @property
    def failed_steps(self) -> list[int]:
        return sorted(s for s, c in self.steps.items() if not c.ok)

    def raise_if_failed(self) -> None:
        """Raise the first error found (a :class:`CorruptChunkError`, :class:`MissingArrayError`...)."""
        for step in self.failed_steps:
            raise self.steps[step].errors[0]

    def __str__(self) -> str:
        lines = []
        for step, c in sorted(self.steps.items()):
            status = "ok" if c.ok else "FAILED"
            crc = "" if c.checksummed else " (no checksums: written without crc32c)"
            lines.append(f"step {step}: {status}, {c.arrays} arrays, {c.chunks} chunks, "
                         f"{c.bytes / 2**20:.1f} MiB{crc}")
            lines.extend(f"    {p}" for p in c.problems)
        if self.incomplete_steps:
            lines.append(f"incomplete (uncommitted) steps, ignored: {self.incomplete_steps}")
        return "\n".join(lines)


def _chunk_domains(store: ts.TensorStore):
    shape = tuple(store.shape)
    chunk = tuple(store.chunk_layout.read_chunk.shape or shape)
    ranges = [range(0, n, max(1, c)) for n, c in zip(shape, chunk)]
    for origin in itertools.product(*ranges):
        yield tuple(slice(o, min(o + c, n)) for o, c, n in zip(origin, chunk, shape))


def verify_step(location: Location, step: int, step_rel: str, item_name: str, context: ts.Context,
                budget: int) -> StepCheck:
    check = StepCheck(step)
    try:
        view = open_step(location, step, step_rel, item_name)
        leaves = view.array_leaves()
        stores = {}
        for leaf in leaves:
            try:
                stores.update(open_arrays(view, [leaf.name], context))
            except CheckpointError as e:
                check.fail(e)
    except CheckpointError as e:
        check.fail(e)
        return check

    def finish(name, fut):
        store = stores[name]
        check.arrays += 1
        check.chunks += math.prod(math.ceil(n / max(1, c)) for n, c in
                                  zip(store.shape, store.chunk_layout.read_chunk.shape or store.shape))
        if not layout.has_crc32c(store):
            check.checksummed = False
        try:
            fut.result()
            check.bytes += stored_nbytes(store)
        except Exception:  # noqa: BLE001 - localized chunk by chunk below
            _localize(view, name, store, check)

    names = sorted(stores)
    try:
        bounded(names, nbytes=lambda n: stored_nbytes(stores[n]),
                issue=lambda n: PendingRead(stores[n], stores[n].dtype.numpy_dtype), finish=finish,
                budget=budget)
    except CheckpointError as e:  # e.g. an absurd shape refused before allocation
        check.fail(e)
    return check


def _localize(view, name: str, store: ts.TensorStore, check: StepCheck) -> None:
    for domain in _chunk_domains(store):
        try:
            store[domain].read().result()
        except Exception as e:  # noqa: BLE001
            check.fail(read_error(e, step=view.step, path=view.where, array=name))

