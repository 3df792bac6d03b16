"""core.slicing: K slices that tile every leaf, sized so that every window step copies the same bytes."""

from hypothesis import given, settings, strategies as st

import math

import pytest

from overlap_ckpt.core.slicing import Piece, make_slicing, slice_shares, step_copy_share

from conftest import step_copies


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 64)), min_size=1, max_size=12),
       st.integers(1, 9), st.booleans(), st.sampled_from([0.0, 0.125, 1 / 3, 1.0]))
def test_slicing_tiles_every_leaf(units, k, chunkable, grad_per_state):
    rows = [r for r, _ in units]
    row_bytes = [b for _, b in units]
    slicing = make_slicing(rows, row_bytes, k, chunkable, grad_per_state)
    covered = {}
    for sl in slicing.slices:
        assert sl
        for p in sl:
            covered.setdefault(p.leaf, []).append((p.start, p.stop))
    for leaf, n in enumerate(rows):
        spans = sorted(covered[leaf])
        if not chunkable:  # whole-leaf slices: one piece covering every row
            assert spans == [(0, n)], (leaf, spans)
            continue
        pos = 0
        for a, b in spans:
            assert a == pos
            pos = b
        assert pos == n
    assert slicing.k == min(k, sum(rows) if chunkable else len(rows))


def test_whole_leaf_slices_balance_bytes_largest_first():
    slicing = make_slicing([1, 1, 1, 1], [100, 60, 50, 10], 2, chunkable=False)
    loads = [sum([100, 60, 50, 10][p.leaf] for p in s) for s in slicing.slices]
    assert sorted(loads) == [110, 110]


def test_not_enough_rows_lowers_k():
    assert make_slicing([2], [8], 5, chunkable=True).k == 2
    assert make_slicing([3, 1], [8, 8], 5, chunkable=False).k == 2


def test_pieces_upto_are_the_slices_at_the_same_version():
    slicing = make_slicing([6], [4], 3, chunkable=True)
    assert slicing.pieces_upto(0) == slicing.slices[0]
    assert slicing.pieces_upto(2) == tuple(p for s in slicing.slices for p in s)
    assert all(isinstance(p, Piece) for p in slicing.pieces_upto(2))


def test_last_slice_holds_whole_units_unless_that_unbalances_a_slice():
    # A large last unit (a token embedding last in a Linen tree): moving the cut before it
    # keeps every slice within 1.5x an equal share, so the last slice is that unit, whole.
    slicing = make_slicing([16, 16, 16, 16, 40], [72] * 5, 3, chunkable=True)
    assert slicing.slices[-1] == (Piece(4, 0, 40),)
    # One unit that is most of the state stays cut: whole, it would be ~2x an equal share.
    slicing = make_slicing([40, 1], [72, 72], 2, chunkable=True)
    assert slicing.slices[-1][0].start > 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.floats(0.0, 4.0))
def test_shares_make_every_step_copy_the_same(k, g):
    shares = slice_shares(k, g)
    assert len(shares) == k and all(x > 0 for x in shares)
    assert math.fsum(shares) == pytest.approx(1.0, rel=1e-12)
    copies = step_copies(shares, g)
    assert max(copies) == pytest.approx(min(copies), rel=1e-9)
    assert step_copy_share(k, g) == pytest.approx(copies[-1], rel=1e-9)
    # Equal slices copy more at their largest step, unless no gradient rides along.
    equal = step_copies([1 / k] * k, g)
    assert max(copies) <= max(equal) * (1 + 1e-12)


def test_adam_shares_at_k3():
    # Adam in f32: the gradient is a third of a unit's state (param, mu, nu). Slices of
    # 0.324, 0.243 and 0.432 of the state make each step copy 0.432 of it; equal slices
    # copy 0.444, 0.556 and 0.333.
    assert slice_shares(3, 1 / 3) == pytest.approx([24 / 74, 18 / 74, 32 / 74], rel=1e-12)
    assert slice_shares(3, 0.0) == pytest.approx([1 / 3] * 3, rel=1e-12)


def test_slices_follow_the_shares():
    slicing = make_slicing([740], [10], 3, chunkable=True, grad_per_state=1 / 3)
    assert [p.stop - p.start for s in slicing.slices for p in s] == [240, 180, 320]
    # Whole leaves: largest first, into the slice least full for its share.
    slicing = make_slicing([1, 1, 1], [32, 24, 18], 3, chunkable=False, grad_per_state=1 / 3)
    assert [[p.leaf for p in s] for s in slicing.slices] == [[1], [2], [0]]
