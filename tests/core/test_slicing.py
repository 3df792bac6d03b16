"""core.slicing: K slices that tile every leaf, of about equal bytes."""

from hypothesis import given, settings, strategies as st

from overlap_ckpt.core.slicing import Piece, make_slicing


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 64)), min_size=1, max_size=12),
       st.integers(1, 9), st.booleans())
def test_slicing_tiles_every_leaf(units, k, chunkable):
    rows = [r for r, _ in units]
    row_bytes = [b for _, b in units]
    slicing = make_slicing(rows, row_bytes, k, chunkable)
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
