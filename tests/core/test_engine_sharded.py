"""A state sharded over 4 simulated CPU devices is captured per addressable shard and
replayed exactly (run in a subprocess so the device count can be set)."""

import os

from conftest import REPO, run_python

CODE = r'''
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from conftest import make_params, run_loop, check_windows
assert jax.device_count() == 4
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
specs = {"w000": P("data", "model"), "w001": P(None, "model"), "w002": P("data"), "w003": P()}
def shard(params):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
for tx, window in ((optax.adam(1e-2), 3), (optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)), 2),
                   (optax.adafactor(1e-2), 2)):
    # Fresh arrays per run: device_put may share a buffer with its source, and donation frees it.
    params = make_params([(64, 8), (6, 12), (40,), (5, 3)])
    engine, sink, refs = run_loop(tx, params, window=window, interval=4, steps=12, shard=shard)
    check_windows(sink, refs)
    saved = sink.saved[4][0]["params"]["w000"]
    # Captured per shard: one host block per distinct device block, not a gathered array.
    assert len(saved.shards) == 4, len(saved.shards)
    assert all(s.data.shape == (32, 4) for s in saved.shards)
# Moments sharded like their parameters: leaves are split into row chunks inside each
# shard (shard_map), and a 3-step window cuts the (64, 8) leaf's 32 local rows.
for tx in (optax.adam(1e-2), optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))):
    params = make_params([(64, 8), (6, 12), (40,), (5, 3)])
    engine, sink, refs = run_loop(tx, params, window=3, interval=4, steps=12, shard=shard, shard_state=True)
    check_windows(sink, refs)
    assert engine.plan.chunked
    assert any(p.stop - p.start < 32 for s in engine.plan.slicing.slices for p in s if p.leaf == 0)
print("SHARDED-OK")
'''


def test_sharded_state_on_four_devices():
    code = "import sys; sys.path.insert(0, %r)\n" % os.path.join(REPO, "tests") + CODE
    result = run_python(code, devices=4)
    assert "SHARDED-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]
