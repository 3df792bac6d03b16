"""Unit tests of the layout helpers: chunking, names, metadata validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_ckpt.storage import InvalidMetadataError
from overlap_ckpt.storage.layout import parse_step_name, parse_tree_metadata, validate_array_name
from overlap_ckpt.storage.location import safe_relpath
from overlap_ckpt.storage.tree import choose_chunk_shape


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 40)), min_size=1, max_size=3),
       st.sampled_from([1, 2, 4]), st.integers(4, 4096))
def test_chunks_tile_every_shard(dims, itemsize, target):
    # dims: (number of shards, shard extent) per axis -> a regular shard grid.
    shape = [n * e for n, e in dims]
    grids = [[slice(i * e, (i + 1) * e) for i in range(n)] for n, e in dims]
    indices = [tuple(idx) for idx in np.array(np.meshgrid(*[range(n) for n, _ in dims], indexing="ij")).reshape(len(dims), -1).T.tolist()]
    shard_indices = [tuple(grids[d][i] for d, i in enumerate(idx)) for idx in indices]
    chunk = choose_chunk_shape(shape, itemsize, shard_indices, target)
    for d, (n, e) in enumerate(dims):
        if n > 1:  # sharded axis: chunk boundaries fall on shard boundaries
            assert e % chunk[d] == 0
        assert 1 <= chunk[d] <= shape[d]
    # Unsharded arrays can always be split down to the size bound; sharded axes only to
    # divisors of the shard extent.
    if all(n == 1 for n, _ in dims):
        assert itemsize * math.prod(chunk) <= max(target, itemsize)


def test_chunk_examples():
    full = [(slice(0, 1000), slice(0, 1000))]
    assert choose_chunk_shape((1000, 1000), 4, full, 1 << 30) == (1000, 1000)
    chunk = choose_chunk_shape((1000, 1000), 4, full, 400_000)
    assert chunk == (100, 1000)
    # A prime leading axis held by one shard is split into near-equal pieces, not single rows.
    assert choose_chunk_shape((50257, 64), 4, [(slice(0, 50257), slice(0, 64))], 1 << 20)[0] > 1000
    assert choose_chunk_shape((), 4, [()], 16) == ()
    assert choose_chunk_shape((0, 3), 4, [(slice(0, 0), slice(0, 3))], 16) == (1, 3)


def test_step_names():
    assert parse_step_name("12") == (12, True)
    assert parse_step_name("12.orbax-checkpoint-tmp") == (12, False)
    assert parse_step_name("12.orbax-checkpoint-tmp-1700000000") == (12, False)
    assert parse_step_name("12.orbax-checkpoint-tmp-deleting") == (12, False)
    for bad in ("x", "12a", ".overlap_ckpt.lock", "-1", ""):
        assert parse_step_name(bad) is None


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/../../b", "a\\b", "a\x00"])
def test_safe_relpath_refuses_escapes(bad):
    with pytest.raises(InvalidMetadataError):
        safe_relpath(bad)


def test_array_names():
    assert validate_array_name("opt_state.0.mu.dense.kernel")
    for bad in ("", ".", "..", "a/b", "a\\b", "tab\there"):
        with pytest.raises(InvalidMetadataError):
            validate_array_name(bad)


@pytest.mark.parametrize("doc", [
    b"[]", b"{}", b'{"tree_metadata": {}}',
    b'{"tree_metadata": {"x": {"key_metadata": [], "value_metadata": {"value_type": "np.ndarray"}}}}',
    b'{"tree_metadata": {"x": {"key_metadata": [{"key": "a", "key_type": 7}], "value_metadata": {"value_type": "np.ndarray"}}}}',
    b'{"tree_metadata": {"x": {"key_metadata": [{"key": "a", "key_type": 2}], "value_metadata": {}}}}',
    b'{"tree_metadata": {"x": {"key_metadata": [{"key": "a", "key_type": 2}], "value_metadata": {"value_type": "np.ndarray"}}}, "use_zarr3": "yes"}',
    b"\xff\xfe",
])
def test_tree_metadata_validation(doc):
    with pytest.raises(InvalidMetadataError):
        parse_tree_metadata(doc, "_METADATA")
