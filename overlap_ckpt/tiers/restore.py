"""Restoring a local-tier step in a multi-process job, where each process holds only the
blocks it owned.

Why: the capture keeps replica 0 of each block and nothing else (host memory and bytes
written stay one copy of the state), so each process's local tier holds the blocks whose
replica 0 lived on its devices, in the layout the window captured them in (its *written*
layout, recorded in the step, see :func:`layouts_of`). That layout need not be the one the
job restores onto: a replicated bias is in process 0's local tier only, yet every process's
devices need it; the window captures a parameter and its moments in one layout
(:func:`overlap_ckpt.core.plan.unit_layouts`) although the job keeps the moments replicated;
a state created again under ``jax.jit`` may be laid out otherwise than the one that trained.

So the restore runs in three moves, all on the job's own devices:

1. each process reads the blocks it wrote: the written sharding restricted to the devices
   at index 0 of every mesh axis the leaf is replicated over (exactly the replica-0
   devices, which hold the same blocks);
2. those blocks are placed on the full written sharding, with zeros on the other replicas,
   and summed over the replicated mesh axes as unsigned integers of the same width (one
   non-zero term per element: exact, bit for bit, -0.0 and NaN payloads included) with
   jax's own collectives;
3. the leaf is resharded onto the target's sharding (by XLA's collectives, when the two
   differ).

A step written before layouts were recorded is read as if written in the target's layout.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


LAYOUT_KEY = "local_tier_layouts"  # custom step metadata: the written layout of each leaf


def layouts_of(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """The written layouts of ``(name, sharding)`` pairs as step metadata (JSON): the meshes
    once (axis names, shape, device ids), and per leaf on a mesh its mesh and spec."""
    meshes: list[dict] = []
    leaves = {}
    for name, sharding in named:
        if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
            continue
        mesh = {"axes": list(sharding.mesh.axis_names), "shape": list(sharding.mesh.devices.shape),
                "devices": [int(d.id) for d in sharding.mesh.devices.flat]}
        if mesh not in meshes:
            meshes.append(mesh)
        spec = [list(e) if isinstance(e, tuple) else e for e in sharding.spec]
        leaves[name] = [meshes.index(mesh), spec]
    return {"meshes": meshes, "leaves": leaves}


def written_shardings(layouts: dict[str, Any] | None) -> dict[str, NamedSharding]:
    """:func:`layouts_of`'s metadata back as shardings on this job's devices, by leaf name.
    Raises ``ValueError`` when a recorded device is not in this job (another topology)."""
    if not layouts:
        return {}
    devices = {d.id: d for d in jax.devices()}
    meshes = []
    for mesh in layouts["meshes"]:
        missing = [i for i in mesh["devices"] if i not in devices]
        if missing:
            raise ValueError(f"the step was written on devices {missing} that this job does not have")
        grid = np.array([devices[i] for i in mesh["devices"]], dtype=object).reshape(mesh["shape"])
        meshes.append(Mesh(grid, tuple(mesh["axes"])))
    return {name: NamedSharding(meshes[m], PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec)))
            for name, (m, spec) in layouts["leaves"].items()}


def owned_target(target: Any, written: dict[str, NamedSharding] | None = None) -> Any:
    """``target`` with every mesh-sharded leaf in its written layout (``written``, by leaf
    name; the target's own where not recorded) restricted to its replica-0 devices."""
    named, treedef = _named_leaves(target)
    return treedef.unflatten([_owned_leaf(leaf, _written(name, leaf, written)) for name, leaf in named])


def spread(owned: Any, target: Any, written: dict[str, NamedSharding] | None = None) -> Any:
    """Arrays read onto :func:`owned_target` placed on ``target``'s shardings (a leaf this
    process owns no block of was not read here: ``None``)."""
    named, treedef = _named_leaves(target)
    return treedef.unflatten([_spread_leaf(o, like, _written(name, like, written))
                              for o, (name, like) in zip(treedef.flatten_up_to(owned), named)])


def _named_leaves(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(leaf_name(path), leaf) for path, leaf in flat], treedef


def leaf_name(path: Any) -> str:
    """A leaf's name in the step (as the saved array is named)."""
    from ..storage.tree import key_name_and_type

    return ".".join(key_name_and_type(k)[0] for k in path)


def _written(name: str, leaf: Any, written: dict[str, NamedSharding] | None) -> NamedSharding | None:
    target = _sharding_of(leaf)
    recorded = (written or {}).get(name)
    if target is None or recorded is None or recorded.device_set != target.device_set:
        return target
    return recorded


def _replicated_axes(sharding: NamedSharding) -> tuple[str, ...]:
    used = set()
    for entry in sharding.spec:
        used.update(entry if isinstance(entry, tuple) else (entry,))
    return tuple(a for a in sharding.mesh.axis_names if a not in used)


def _sharding_of(leaf: Any) -> NamedSharding | None:
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) else None


def _owned_leaf(leaf: Any, sharding: NamedSharding | None) -> Any:
    if sharding is None:
        return leaf
    if not _replicated_axes(sharding):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    mesh, replicated = sharding.mesh, _replicated_axes(sharding)
    first = tuple(slice(0, 1) if name in replicated else slice(None) for name in mesh.axis_names)
    owners = NamedSharding(Mesh(mesh.devices[first], mesh.axis_names), sharding.spec)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=owners)


def _spread_leaf(owned: Any, like: Any, sharding: NamedSharding | None) -> Any:
    if sharding is None:
        return owned
    target = _sharding_of(like)
    if _replicated_axes(sharding):
        owned = _replicas_filled(owned, tuple(like.shape), np.dtype(like.dtype), sharding)
    return owned if sharding.is_equivalent_to(target, len(like.shape)) else _resharded(target)(owned)


@functools.lru_cache(maxsize=None)
def _resharded(target: NamedSharding):
    """The identity onto ``target``: XLA moves the blocks between the processes' devices."""
    return jax.jit(lambda x: x, out_shardings=target)


def _replicas_filled(owned: Any, shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding) -> Any:
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


__all__ = ["LAYOUT_KEY", "layouts_of", "written_shardings", "owned_target", "spread", "leaf_name"]
