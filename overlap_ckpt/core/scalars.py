"""The wire format of the global scalars a window step ships to the host.

A step under ``clip_by_global_norm`` on a large tree records hundreds of rank-0 values (see
:mod:`.rules`); one transfer each would cost more than the values. The device packs them
into one array per dtype (in order of first appearance) and the host unpacks them with the
plan's signature. Both sides live here so the format has one owner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Signature = tuple[tuple[str, str], ...]  # (primitive, dtype) of each global scalar, in order


def packed_dtypes(signature: Signature) -> list[str]:
    """The dtypes of the packed arrays, in order of first appearance."""
    return list(dict.fromkeys(dtype for _, dtype in signature))


def pack(scalars: list[jax.Array]) -> list[jax.Array]:
    """Device side: one array per dtype."""
    groups: dict[str, list[jax.Array]] = {}
    for value in scalars:
        groups.setdefault(str(jnp.dtype(value.dtype)), []).append(jnp.reshape(value, ()))
    return [jnp.stack(values) for values in groups.values()]


def unpack(packed: list, signature: Signature) -> list:
    """Host side: the scalars in recording order, from the packed arrays."""
    columns = dict(zip(packed_dtypes(signature), packed))
    taken: dict[str, int] = {}
    out = []
    for _, dtype in signature:
        i = taken.get(dtype, 0)
        out.append(columns[dtype][i])
        taken[dtype] = i + 1
    return out
