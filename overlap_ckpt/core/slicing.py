"""Split the train state into K slices so that every window step copies about the same bytes.

Why not K equal slices: window step ``j < K-1`` copies state slice ``j`` *and* the
gradient rows of slices ``0..j`` (the host replays them), and the last step copies its
slice alone. With equal slices the copy grows step by step: at K=3 with Adam (gradient
bytes a third of the state's) the steps copy 0.44, 0.56 and 0.33 of the state. A copy hides
under a step only up to a budget, so the largest one sets the stall. :func:`slice_shares`
sizes the slices so that every step copies the same bytes (0.43 of the state at K=3): the
slices shrink across the window and the last is the largest. The host also replays fewer
bytes and keeps less between windows (its copies of slices ``0..K-2``; the last one it
adopts as captured).

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
import itertools
import logging
import math
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


def slice_shares(k: int, grad_per_state: float) -> list[float]:
    """The fractions of the state in slices ``0..k-1`` at which every window step copies
    the same bytes, when a unit's gradient is ``grad_per_state`` (``g``) times its state.

    Step ``j < k-1`` copies ``s_j + g * (s_0 + .. + s_j)``, the last step ``s_{k-1}``.
    Setting each to a common ``b``: ``s_0 = b/(1+g)`` and, step by step,
    ``s_j = s_{j-1}/(1+g)``, while ``s_{k-1} = b``. So the slices before the last shrink
    geometrically, the last is the largest, and ``g = 0`` gives equal slices.
    """
    if k < 1:
        raise ValueError(f"window size must be >= 1, got {k}")
    if grad_per_state < 0:
        raise ValueError(f"grad_per_state must be >= 0, got {grad_per_state}")
    ratio = 1.0 / (1.0 + grad_per_state)
    shares = [ratio ** (j + 1) for j in range(k - 1)] + [1.0]
    total = math.fsum(shares)
    return [x / total for x in shares]


def step_copy_share(k: int, grad_per_state: float) -> float:
    """The fraction of the state every window step copies with :func:`slice_shares`' slices
    (the last share), in closed form so that a cost model may ask about any K.

    The unscaled shares sum to ``1 + (1 - (1+g)^-(k-1)) / g`` (a geometric series). As K
    grows the copy falls towards ``g / (1+g)`` of the state: every step carries at least
    the gradient rows of the slices before it.
    """
    if k < 1:
        raise ValueError(f"window size must be >= 1, got {k}")
    if grad_per_state <= 0:
        return 1.0 / k
    before_last = -math.expm1(-(k - 1) * math.log1p(grad_per_state)) / grad_per_state
    return 1.0 / (1.0 + before_last)


def make_slicing(rows: Sequence[int], row_bytes: Sequence[int], k: int, chunkable: bool,
                 grad_per_state: float = 0.0) -> Slicing:
    """Split units (``rows[i]`` rows of ``row_bytes[i]`` bytes each) into ``k`` slices of
    :func:`slice_shares` of the bytes (equal slices when ``grad_per_state`` is 0).

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
    shares = slice_shares(k, grad_per_state)
    if chunkable:
        return Slicing(_whole_last_slice(_chunked(rows, row_bytes, shares), rows, row_bytes, grad_per_state))
    return Slicing(_whole(rows, row_bytes, shares))


def _chunked(rows: Sequence[int], row_bytes: Sequence[int], shares: Sequence[float]) -> tuple[tuple[Piece, ...], ...]:
    k = len(shares)
    total = sum(r * b for r, b in zip(rows, row_bytes))
    ends = list(itertools.accumulate(shares))
    slices: list[list[Piece]] = [[] for _ in range(k)]
    current, filled = 0, 0
    for leaf, (n_rows, nbytes) in enumerate(zip(rows, row_bytes)):
        start = 0
        while start < n_rows:
            remaining_slices = k - current
            # Never leave later slices without rows to take.
            rows_left_after = sum(rows[leaf + 1:]) + (n_rows - start)
            boundary = total * ends[current]
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


LAST_SLICE_SLACK = 1.5  # x the balanced copy: how large a step's copy may grow to keep the last slice whole


def _whole_last_slice(slices: tuple[tuple[Piece, ...], ...], rows: Sequence[int],
                      row_bytes: Sequence[int], grad_per_state: float) -> tuple[tuple[Piece, ...], ...]:
    """Move the cut between the last two slices to the nearest unit boundary, when neither
    of their window steps then copies more than :data:`LAST_SLICE_SLACK` x the balanced
    copy (the last slice's bytes as cut).

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

    head_bytes = sum(nbytes(s) for s in head)

    def copies(option) -> tuple[float, float]:
        """What the last two window steps copy: a slice and the gradient rows of all
        slices up to it, then the last slice alone."""
        return nbytes(option[0]) + grad_per_state * (head_bytes + nbytes(option[0])), nbytes(option[1])

    limit = LAST_SLICE_SLACK * nbytes(last)
    options = []
    if len(last) > 1:  # the cut unit's last rows join the slice before
        options.append((before[:-1] + [Piece(cut.leaf, before[-1].start, cut.stop)], last[1:]))
    if len(before) > 1 and before[-1].start == 0:  # the whole cut unit joins the last slice
        options.append((before[:-1], [Piece(cut.leaf, 0, rows[cut.leaf])] + last[1:]))
    fits = [o for o in options if max(copies(o)) <= limit]
    if not fits:
        return slices
    best = min(fits, key=lambda o: max(copies(o)))
    return tuple(tuple(s) for s in (*head, *best))


def _whole(rows: Sequence[int], row_bytes: Sequence[int], shares: Sequence[float]) -> tuple[tuple[Piece, ...], ...]:
    """Largest unit first: into an empty slice while there is one (the one of the largest
    share), then into the slice that is least full for its share."""
    k = len(shares)
    sizes = [r * b for r, b in zip(rows, row_bytes)]
    loads = [0] * k
    slices: list[list[Piece]] = [[] for _ in range(k)]
    for leaf in sorted(range(len(rows)), key=lambda i: -sizes[i]):
        target = min(range(k), key=lambda s: (loads[s] > 0, (loads[s] + sizes[leaf]) / shares[s], s))
        slices[target].append(Piece(leaf, 0, rows[leaf]))
        loads[target] += sizes[leaf]
    return tuple(tuple(sorted(s)) for s in slices if s)
