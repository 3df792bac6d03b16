"""Split the train state into K slices of about equal bytes.

A *unit* is one parameter leaf together with the optimizer-state leaves it owns (Adam's
``mu``/``nu`` of that kernel): they are captured together, because the host replays them
together. When the update is elementwise a unit may be cut into row chunks (rows of the
local shard, so sharded leaves are cut the same way on every device); otherwise a unit is
indivisible and slices are filled greedily, largest unit first.

Row chunks keep the last slice on whole units where that costs little balance (see
:func:`_whole_last_slice`): the host adopts the last slice's captured arrays as its copy
and owns memory only for what it replays, slices ``0..K-2``.
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
        return Slicing(_whole_last_slice(_chunked(rows, row_bytes, k), rows, row_bytes))
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


LAST_SLICE_SLACK = 1.5  # x an equal share: how large a slice may grow to keep the last slice whole


def _whole_last_slice(slices: tuple[tuple[Piece, ...], ...], rows: Sequence[int],
                      row_bytes: Sequence[int]) -> tuple[tuple[Piece, ...], ...]:
    """Move the cut between the last two slices to the nearest unit boundary, when neither
    slice then exceeds :data:`LAST_SLICE_SLACK` x an equal share of the bytes.

    Why: the host keeps a block per leaf. The last slice arrives at version V and is never
    replayed, so a unit it holds whole is kept as captured (no copy, no host memory of
    its own), but a unit cut between the last two slices needs a host block for all its
    rows, the last slice's included: on the 20M LM at K=3 the token embedding (0.4x the
    state) was cut that way and the host owned the whole state instead of 0.6x of it.
    """
    if len(slices) < 2 or slices[-1][0].start == 0 or slices[-2][-1].leaf != slices[-1][0].leaf:
        return slices
    *head, before, last = (list(s) for s in slices)
    cut = last[0]

    def nbytes(pieces) -> int:
        return sum((p.stop - p.start) * row_bytes[p.leaf] for p in pieces)

    limit = LAST_SLICE_SLACK * nbytes([p for s in slices for p in s]) / len(slices)
    options = []
    if len(last) > 1:  # the cut unit's last rows join the slice before
        options.append((before[:-1] + [Piece(cut.leaf, before[-1].start, cut.stop)], last[1:]))
    if len(before) > 1 and before[-1].start == 0:  # the whole cut unit joins the last slice
        options.append((before[:-1], [Piece(cut.leaf, 0, rows[cut.leaf])] + last[1:]))
    fits = [o for o in options if max(nbytes(o[0]), nbytes(o[1])) <= limit]
    if not fits:
        return slices
    best = min(fits, key=lambda o: max(nbytes(o[0]), nbytes(o[1])))
    return tuple(tuple(s) for s in (*head, *best))


def _whole(rows: Sequence[int], row_bytes: Sequence[int], k: int) -> tuple[tuple[Piece, ...], ...]:
    sizes = [r * b for r, b in zip(rows, row_bytes)]
    loads = [0] * k
    slices: list[list[Piece]] = [[] for _ in range(k)]
    for leaf in sorted(range(len(rows)), key=lambda i: -sizes[i]):
        target = min(range(k), key=lambda s: (loads[s], s))
        slices[target].append(Piece(leaf, 0, rows[leaf]))
        loads[target] += sizes[leaf]
    return tuple(tuple(sorted(s)) for s in slices if s)
