"""core.buffers: captured pieces land in the right host blocks; whole blocks are adopted."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from overlap_ckpt.core.buffers import LeafBlocks, host_array, store_piece, store_whole
from overlap_ckpt.core.plan import leaf_layout
from overlap_ckpt.core.slicing import Piece
from overlap_ckpt.errors import WindowAborted


def test_row_pieces_fill_a_block_and_whole_pieces_are_adopted():
    x = jnp.arange(12.0).reshape(6, 2)
    blocks = LeafBlocks(leaf_layout(x))
    store_piece(blocks, x[0:4], Piece(0, 0, 4))
    store_piece(blocks, x[4:6], Piece(0, 4, 6))
    np.testing.assert_array_equal(host_array(blocks).to_numpy(), np.asarray(x))
    adopted = LeafBlocks(leaf_layout(x))
    store_piece(adopted, x, Piece(0, 0, 6), adopt=True)
    view = host_array(adopted).shards[0].data
    assert not view.flags.writeable  # a view of the captured array, not a copy
    with pytest.raises(WindowAborted, match="handed over"):
        adopted[((0, 6), (0, 2))]
    adopted.release_views()
    assert adopted[((0, 6), (0, 2))].flags.writeable


def test_whole_leaf_copied_by_overlap_and_a_missing_part_aborts():
    x = jnp.arange(8.0)
    layout = leaf_layout(x)
    blocks = LeafBlocks(layout)
    store_whole(blocks, x)
    np.testing.assert_array_equal(host_array(blocks).to_numpy(), np.arange(8.0))
    short = LeafBlocks(layout)
    with pytest.raises(WindowAborted, match="covers 4 of the 8"):
        store_whole(short, _fake(np.arange(4.0), (8,)))


class _Shard:
    def __init__(self, data, index):
        self.data, self.index, self.replica_id = data, index, 0


class _fake:
    """A captured array whose only shard covers the first half of the leaf."""

    def __init__(self, data, shape):
        self.shape = shape
        self.addressable_shards = [_Shard(data, (slice(0, len(data)),))]
