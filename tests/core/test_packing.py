"""core.packing: a window phase's outbox packed into one host copy per element width on each
device, cut back on the host into exactly what the per-leaf capture gives.

Packing is off on the CPU backend by default (a CPU copy is a memcpy; packing would add
one), so these tests force it with ``pack_outbox=True``, and the hybrid TPU plans make
(only the small items packed, the others copied each on its own) with a small
``pack_max_bytes``. References: a synchronous
snapshot of the live state (the engine's checkpoints, bit for bit) and numpy slices of the
global arrays (the unpacked blocks), with FSDP over 4 simulated CPU devices in a subprocess.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from overlap_ckpt.core import packing
from overlap_ckpt.core.capture import capture_state
from overlap_ckpt.core import ticket
from overlap_ckpt.core.ticket import WindowTicket
from overlap_ckpt.core.plan import make_plan

from conftest import REPO, make_params, run_python

# The engine loop of conftest.run_loop with packing forced on (the loop makes its engine
# from conftest's OverlapEngine name), checked against synchronous snapshots.
FORCE_PACKING = r'''
import functools, sys
sys.path.insert(0, %r)
import conftest
conftest.OverlapEngine = functools.partial(conftest.OverlapEngine, pack_outbox=True)
from conftest import check_windows, make_params, run_loop
def check_plan(plan):
    assert plan.pack_outbox and plan.pack_max_bytes is None
'''

# The same with only the items of at most HYBRID_BYTES per device packed (as TPU plans pack
# those up to 1 MiB): the engine's plans get the limit; every plan must mix both kinds.
HYBRID_BYTES = 100
FORCE_HYBRID = FORCE_PACKING + r'''
from overlap_ckpt.core import engine as engine_module, packing, plan as plan_module
engine_module.make_plan = functools.partial(plan_module.make_plan, pack_max_bytes=%d)
def check_plan(plan):
    assert plan.pack_outbox and plan.pack_max_bytes == %d
    for phase in range(plan.k):
        items = packing.phase_items(plan, phase, True).state_items() + list(packing.grad_items(plan, phase))
        mask = packing.selected(plan, items)
        assert any(mask) and not all(mask), (phase, mask)
''' % (HYBRID_BYTES, HYBRID_BYTES)

SHARDED = r'''
import jax, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
assert jax.device_count() == 4
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
specs = {"w000": P("data", "model"), "w001": P(None, "model"), "w002": P("data"), "w003": P(), "w004": P()}
def shard(params):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
clip_adamw = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
for tx, window, shard_state in ((optax.adam(1e-2), 3, False), (clip_adamw, 2, False), (optax.adafactor(1e-2), 2, False),
                                (optax.adam(1e-2), 3, True), (clip_adamw, 3, True)):
    params = make_params([(64, 8), (6, 12), (40,), (5, 3), ()])
    engine, sink, refs = run_loop(tx, params, window=window, interval=4, steps=12, shard=shard,
                                  shard_state=shard_state)
    check_plan(engine.plan)
    check_windows(sink, refs)
    saved = sink.saved[4][0]["params"]["w000"]
    # The host copy keeps the device's blocks; with row chunks its shards are the rows of
    # each block that each replay call (or the last slice's capture) holds.
    assert len(saved.blocks) == 4 and all(tuple(b.stop - b.start for b in index) == (32, 4) for index in saved.blocks)
    assert sum(map(len, saved.shards_by_block())) == len(saved.shards) and saved.is_fully_addressable
    if shard_state:  # row chunks: a 3-step window cuts the (64, 8) leaf's 32 local rows
        assert engine.plan.chunked and len(saved.shards) > 4
        assert any(p.stop - p.start < 32 for s in engine.plan.slicing.slices for p in s if p.leaf == 0)
print("PACKED-SHARDED-OK")
'''


@pytest.mark.parametrize("force", [FORCE_PACKING, FORCE_HYBRID], ids=["packed", "hybrid"])
def test_packed_checkpoints_are_bitwise_with_fsdp_on_four_devices(force):
    code = force % os.path.join(REPO, "tests") + SHARDED
    result = run_python(code, devices=4)
    assert "PACKED-SHARDED-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


@pytest.mark.parametrize("force", [FORCE_PACKING, FORCE_HYBRID], ids=["packed", "hybrid"])
def test_packed_checkpoints_are_bitwise_on_one_device(force):
    code = force % os.path.join(REPO, "tests") + r'''
import jax.numpy as jnp, optax
for tx, window in ((optax.adam(1e-2), 3), (optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), 2),
                   (optax.adafactor(1e-2), 2)):
    params = make_params([(64, 8), (6, 12), (40,), (5, 3), ()])
    params["w005"] = jnp.arange(6, dtype=jnp.bfloat16)  # a second dtype: two packed copies
    engine, sink, refs = run_loop(tx, params, window=window, interval=4, steps=12)
    check_plan(engine.plan)
    check_windows(sink, refs)
print("PACKED-ONE-OK")
'''
    result = run_python(code, devices=1)
    assert "PACKED-ONE-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


def test_one_host_copy_per_element_width_cut_back_into_views_of_the_leaves_rows():
    params = make_params([(12, 3), (5,), ()])
    params["h"] = jnp.arange(8, dtype=jnp.bfloat16).reshape(4, 2)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    plan = make_plan(tx, params, opt_state, None, 2, pack_outbox=True)
    assert plan.pack_outbox and not make_plan(tx, params, opt_state, None, 2).pack_outbox  # CPU default: off
    copies = []
    for phase in range(plan.k):
        outbox = jax.jit(capture_state)(WindowTicket(plan, phase), params, opt_state, None)
        items = packing.phase_items(plan, phase, False).state_items()
        # float32 and int32 leaves share a copy (as uint32 bits); bfloat16 has its own
        widths = {np.dtype(item.layout.dtype).itemsize for item in items}
        copies.append(len(outbox.packed))
        assert len(outbox.packed) == len(widths)
        assert {x.sharding.memory_kind for x in outbox.packed} == {"pinned_host"}
        unpacked = ticket.unpacked(outbox)
        buffers = [(x.addressable_shards[0].data.unsafe_buffer_pointer(), x.nbytes) for x in outbox.packed]
        sources = {"params": jax.tree.leaves(params), "state": jax.tree.leaves(opt_state)}
        entries = [entry for _, part in packing.phase_items(plan, phase, False).parts() for entry in part]
        for (source, item), got in zip(entries, [*unpacked.state, *unpacked.shared], strict=True):
            want = np.asarray(sources[source][item.piece.leaf])
            if want.ndim:
                want = want[item.piece.start:item.piece.stop]
            (shard,) = got.addressable_shards
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(shard.data, want)
            # a view into the packed host copy's own buffer, not a copy of it
            address = shard.data.__array_interface__["data"][0]
            assert any(start <= address and address + shard.data.nbytes <= start + n for start, n in buffers)
    assert sorted(copies) == [1, 2]


def test_hybrid_outbox_packs_the_small_items_and_copies_the_others_on_their_own():
    """With ``pack_max_bytes`` (TPU plans: 1 MiB) the items up to it share the packed copies
    and the larger ones keep a host copy each, in the lists; unpacking merges them back in
    item order, as the per-leaf capture gives them."""
    params = make_params([(12, 3), (5,), (40, 2), ()])
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    plan = make_plan(tx, params, opt_state, None, 2, pack_outbox=True, pack_max_bytes=100)
    assert plan.pack_max_bytes == 100
    reference = make_plan(tx, params, opt_state, None, 2)  # per-leaf (CPU default)
    for phase in range(plan.k):
        outbox = jax.jit(capture_state)(WindowTicket(plan, phase), params, opt_state, None)
        items = packing.phase_items(plan, phase, False).state_items()
        mask = packing.selected(plan, items)
        assert mask == [item.local_bytes <= 100 for item in items] and any(mask) and not all(mask)
        assert len(outbox.state) + len(outbox.shared) == mask.count(False)
        assert len(outbox.packed) == len(packing.groups([i for i, m in zip(items, mask) if m]))
        got = ticket.unpacked(outbox)
        want = jax.jit(capture_state)(WindowTicket(reference, phase), params, opt_state, None)
        assert got.packed == [] and got.packing is None
        entries = [entry for _, part in packing.phase_items(plan, phase, False).parts() for entry in part]
        for (source, item), g, w in zip(entries, [*got.state, *got.shared], [*want.state, *want.shared], strict=True):
            assert g.shape == w.shape and np.dtype(g.dtype) == np.dtype(w.dtype), item
            np.testing.assert_array_equal(np.asarray(g.addressable_shards[0].data), np.asarray(w))
