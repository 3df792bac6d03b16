"""Restoring a local-tier step in a multi-process job, where each process holds only the
blocks it owned.

Why: the capture keeps replica 0 of each block and nothing else (host memory and bytes
written stay one copy of the state), so each process's local tier holds the blocks whose
replica 0 lived on its devices. A replicated leaf (the step counter, a replicated bias) is
in process 0's local tier only, yet every process's devices need it.

So the restore runs in two moves, both on the target's own meshes:

1. each process reads its owned blocks: the target sharding restricted to the devices at
   index 0 of every mesh axis the leaf is replicated over (exactly the replica-0 devices,
   which hold the same blocks);
2. those blocks are placed on the full target sharding, with zeros on the other replicas,
   and summed over the replicated mesh axes as unsigned integers of the same width (one
   non-zero term per element: exact, bit for bit, -0.0 and NaN payloads included) with
   jax's own collectives.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def owned_target(target: Any) -> Any:
    """``target`` with every mesh-sharded leaf restricted to its replica-0 devices."""
    return jax.tree.map(_owned_leaf, target)


def spread(owned: Any, target: Any) -> Any:
    """Arrays read onto :func:`owned_target` placed on ``target``'s shardings (a leaf this
    process owns no block of was not read here: ``None``)."""
    leaves, treedef = jax.tree.flatten(target)
    return treedef.unflatten([_spread_leaf(o, like) for o, like in zip(treedef.flatten_up_to(owned), leaves)])


def _replicated_axes(sharding: NamedSharding) -> tuple[str, ...]:
    used = set()
    for entry in sharding.spec:
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return tuple(a for a in sharding.mesh.axis_names if a not in used)


def _sharding_of(leaf: Any) -> NamedSharding | None:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) else None


def _owned_leaf(leaf: Any) -> Any:
    sharding = _sharding_of(leaf)
    if sharding is None or not _replicated_axes(sharding):
        return leaf
    mesh, replicated = sharding.mesh, _replicated_axes(sharding)
    first = tuple(slice(0, 1) if name in replicated else slice(None) for name in mesh.axis_names)
    owners = NamedSharding(Mesh(mesh.devices[first], mesh.axis_names), sharding.spec)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=owners)


def _spread_leaf(owned: Any, like: Any) -> Any:
    sharding = _sharding_of(like)
    if sharding is None or not _replicated_axes(sharding):
        return owned
    shape, dtype = tuple(like.shape), np.dtype(like.dtype)
    held = {} if owned is None else {shard.device: shard.data for shard in owned.addressable_shards}
    blocks = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        if device in held:
            blocks.append(held[device])
        else:
            extent = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
            blocks.append(jax.device_put(np.zeros(extent, dtype), device))
    partial = jax.make_array_from_single_device_arrays(shape, sharding, blocks)
    return _sum_over_replicas(sharding, dtype)(partial)


@functools.lru_cache(maxsize=None)
def _sum_over_replicas(sharding: NamedSharding, dtype: np.dtype):
    axes = _replicated_axes(sharding)
    as_bool = dtype == np.bool_
    uint = _UINT[1 if as_bool else dtype.itemsize]

    def combine(block):
        bits = block.astype(uint) if as_bool else jax.lax.bitcast_convert_type(block, uint)
        total = jax.lax.psum(bits, axes)
        return total.astype(dtype) if as_bool else jax.lax.bitcast_convert_type(total, dtype)

    mapped = jax.shard_map(combine, mesh=sharding.mesh, in_specs=sharding.spec, out_specs=sharding.spec,
                           check_vma=False)
    return jax.jit(mapped, out_shardings=sharding)


__all__ = ["owned_target", "spread"]
