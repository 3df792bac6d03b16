"""hostarray: a jax.Array as this process's host blocks (the one place that does it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from overlap_ckpt.hostarray import (HostArray, HostShard, covers, extent, index_from_key, index_key, local_blocks,
                                    normalize_index)


def test_index_helpers():
    index = normalize_index((slice(None), slice(2, None)), (4, 6))
    assert index == (slice(0, 4), slice(2, 6)) and extent(index) == (4, 4)
    assert index_from_key(index_key(index)) == index and hash(index_key(index))
    assert covers((4, 6), [(slice(0, 2), slice(0, 6)), (slice(2, 4), slice(0, 6))])
    assert not covers((4, 6), [(slice(0, 2), slice(0, 6))])


def test_from_jax_copies_or_views_and_refuses_typed_keys():
    x = jnp.arange(6.0).reshape(2, 3)
    copy = HostArray.from_jax(x, copy=True)
    assert copy.shards[0].data.flags.writeable and copy.to_numpy().tolist() == np.arange(6.0).reshape(2, 3).tolist()
    view = HostArray.from_jax(x, copy=False)
    assert not view.shards[0].data.flags.writeable
    assert [index for index, _ in local_blocks(x)] == [(slice(0, 2), slice(0, 3))]
    with pytest.raises(TypeError, match="key_data"):
        HostArray.from_jax(jax.random.key(0), copy=True, where="rng")


def test_parts_are_grouped_by_the_block_that_holds_them():
    """A writer keeps the parts of one block in one transaction (a chunk two parts share is
    then written once): the groups follow the layout's blocks, whatever the parts' order."""
    full = np.arange(40, dtype=np.float32).reshape(8, 5)
    rows = [(4, 6), (0, 3), (6, 8), (3, 4)]
    parts = [HostShard((slice(a, b), slice(0, 5)), full[a:b]) for a, b in rows]
    blocks = ((slice(0, 4), slice(0, 5)), (slice(4, 8), slice(0, 5)))
    groups = HostArray((8, 5), np.dtype(np.float32), parts, blocks).shards_by_block()
    assert [[s.index[0].start for s in g] for g in groups] == [[0, 3], [4, 6]]
    alone = HostArray((8, 5), np.dtype(np.float32), parts).shards_by_block()  # no blocks: each shard is one
    assert [[s.index[0].start for s in g] for g in alone] == [[4], [0], [6], [3]]
