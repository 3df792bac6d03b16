"""Split the train state into K slices of about equal bytes.

A *unit* is one parameter leaf together with the optimizer-state leaves it owns (Adam's
``mu``/``nu`` of that kernel): they are captured together, because the host replays them
together. When the update is elementwise a unit may be cut into row chunks (rows of the
local shard, so sharded leaves are cut the same way on every device); otherwise a unit is
indivisible and slices are filled greedily, largest unit first.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
    """Rows ``[start, stop)`` of every local block of parameter leaf ``leaf`` (and of the
    state leaves it owns). Scalars and whole-leaf pieces cover all rows."""

    leaf: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Slicing:
    slices: tuple[tuple[Piece, ...], ...]

    @property
    def k(self) -> int:
        return len(self.slices)

    def pieces_upto(self, j: int) -> tuple[Piece, ...]:
        """Pieces of slices 0..j: the ones at the same version after step j's capture."""
        return tuple(p for s in self.slices[: j + 1] for p in s)


def make_slicing(rows: Sequence[int], row_bytes: Sequence[int], k: int, chunkable: bool) -> Slicing:
    """Split units (``rows[i]`` rows of ``row_bytes[i]`` bytes each) into ``k`` slices.

    Returns fewer than ``k`` slices (logged) when there are not enough rows to give every
    slice something: an empty slice would spend a window step capturing nothing.
    """
    if k < 1:
        raise ValueError(f"window size must be >= 1, got {k}")
    total_rows = sum(rows) if chunkable else len(rows)
    if k > max(total_rows, 1):
        log.warning("window of %d steps clamped to %d: the state has only %d %s to spread",
                    k, total_rows, total_rows, "rows" if chunkable else "leaves")
        k = max(total_rows, 1)
    if chunkable:
        return Slicing(_chunked(rows, row_bytes, k))
    return Slicing(_whole(rows, row_bytes, k))


def _chunked(rows: Sequence[int], row_bytes: Sequence[int], k: int) -> tuple[tuple[Piece, ...], ...]:
    total = sum(r * b for r, b in zip(rows, row_bytes))
    slices: list[list[Piece]] = [[] for _ in range(k)]
    current, filled = 0, 0
    for leaf, (n_rows, nbytes) in enumerate(zip(rows, row_bytes)):
        start = 0
        while start < n_rows:
            remaining_slices = k - current
            # Never leave later slices without rows to take.
            rows_left_after = sum(rows[leaf + 1:]) + (n_rows - start)
            boundary = total * (current + 1) / k
            take = n_rows - start
            if current < k - 1:
                fit = int(max(boundary - filled, 0) // max(nbytes, 1))
                take = min(take, max(fit, 1 if not slices[current] else 0))
                take = min(take, rows_left_after - (remaining_slices - 1))
            if take > 0:
                slices[current].append(Piece(leaf, start, start + take))
                start += take
                filled += take * nbytes
            if current < k - 1 and (filled >= boundary - nbytes / 2 or take == 0) and slices[current]:
                current += 1
    return tuple(tuple(s) for s in slices if s)


def _whole(rows: Sequence[int], row_bytes: Sequence[int], k: int) -> tuple[tuple[Piece, ...], ...]:
    sizes = [r * b for r, b in zip(rows, row_bytes)]
    loads = [0] * k
    slices: list[list[Piece]] = [[] for _ in range(k)]
    for leaf in sorted(range(len(rows)), key=lambda i: -sizes[i]):
        target = min(range(k), key=lambda s: (loads[s], s))
        slices[target].append(Piece(leaf, 0, rows[leaf]))
        loads[target] += sizes[leaf]
    return tuple(tuple(sorted(s)) for s in slices if s)
