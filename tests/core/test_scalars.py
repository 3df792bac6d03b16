"""core.scalars: the wire format of the global scalars (one array per dtype)."""

import jax.numpy as jnp
import numpy as np

from overlap_ckpt.core import scalars


def test_pack_unpack_round_trip_keeps_order_across_dtypes():
    values = [jnp.float32(1.5), jnp.bool_(True), jnp.float32(-2.0), jnp.int32(7), jnp.bool_(False)]
    signature = tuple(("p", str(np.dtype(v.dtype))) for v in values)
    packed = scalars.pack(values)
    assert [str(p.dtype) for p in packed] == scalars.packed_dtypes(signature) == ["float32", "bool", "int32"]
    out = scalars.unpack([np.asarray(p) for p in packed], signature)
    assert [o.item() for o in out] == [1.5, True, -2.0, 7, False]
