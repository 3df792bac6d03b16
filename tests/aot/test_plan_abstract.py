"""Planning a state of abstract leaves sharded over a compile-only TPU mesh (FSDP)."""

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import overlap_ckpt as oc
from overlap_ckpt.core.plan import leaf_layout

from .conftest import TPU_TARGET, target_or_skip


def test_sharded_abstract_leaf_has_one_block_per_shard():
    mesh = target_or_skip(TPU_TARGET).mesh()
    fsdp = leaf_layout(jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp"))))
    assert fsdp.block_shape == (2, 3)
    assert [(b[0].start, b[0].stop) for b in fsdp.blocks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    replicated = leaf_layout(jax.ShapeDtypeStruct((8, 3), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec())))
    assert replicated.block_shape == (8, 3) and len(replicated.blocks) == 1


def test_plan_for_abstract_fsdp_state_covers_every_row():
    mesh = target_or_skip(TPU_TARGET).mesh()

    def place(x):
        spec = PartitionSpec("fsdp") if x.ndim and x.shape[0] % 4 == 0 else PartitionSpec()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    params = {"w": place(jax.ShapeDtypeStruct((64, 16), jnp.float32)), "b": place(jax.ShapeDtypeStruct((3,), jnp.float32))}
    tx = optax.adamw(1e-3)
    opt_state = jax.tree.map(place, jax.eval_shape(tx.init, params))
    engine = oc.OverlapEngine(tx, oc.MemorySink(), interval=4, window=3)
    try:
        plan = engine.plan_for(params, opt_state)
    finally:
        engine.close()
    assert plan.platform == "tpu" and plan.k == 3
    rows = {}
    for pieces in plan.slicing.slices:
        for p in pieces:
            rows.setdefault(p.leaf, []).append((p.start, p.stop))
    # every leaf's local rows are captured exactly once over the window
    for leaf, spans in rows.items():
        covered = sorted(spans)
        assert covered[0][0] == 0 and covered[-1][1] == plan.params[leaf].rows
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    assert set(rows) == {0, 1}
