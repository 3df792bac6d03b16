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
    # Captured per shard: one host block per distinct device block, not a gathered array
    # (handed over whole, or as the rows of the replay's calls, each inside one block).
    assert sorted(tuple(b.stop - b.start for b in block) for block in saved.layout_indices) == [(32, 4)] * 4
    assert all(any(all(b.start <= i.start and i.stop <= b.stop for b, i in zip(block, s.index))
                   for block in saved.layout_indices) for s in saved.shards)
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


MOVED_CODE = r'''
import functools, jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from conftest import check_windows
from overlap_ckpt import MemorySink, OverlapEngine, capture_update
mesh = Mesh(np.array(jax.devices()), ("data",))
specs = {"w1": P(None, "data"), "b1": P(), "w2": P("data", None), "b2": P()}
shapes = {"w1": (8, 16), "b1": (16,), "w2": (16, 4), "b2": (4,)}
tx = optax.adam(1e-2)

def loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

@functools.partial(jax.jit, donate_argnums=(1, 2))  # no out_shardings: XLA shards the biases
def step(ticket, params, opt_state, x, y, t):
    grads = jax.grad(loss)(params, x, y)
    return capture_update(tx, ticket, params, opt_state, grads, {"step": t}, step=t)

def run(replan):
    rng = np.random.default_rng(0)
    params = {k: jax.device_put(rng.standard_normal(s, dtype=np.float32), NamedSharding(mesh, specs[k]))
              for k, s in shapes.items()}
    opt_state, sink = tx.init(params), MemorySink()
    engine = OverlapEngine(tx, sink, interval=4, window=2)
    extras = lambda t: {"step": jax.device_put(jnp.int32(t), NamedSharding(mesh, P()))}
    engine.plan_for(params, opt_state, extras(0))
    refs, batch = {}, NamedSharding(mesh, P("data"))
    for t in range(9):
        if replan and engine.phase(t) == 0:
            engine.plan_for(params, opt_state, extras(t))
        data = np.random.default_rng([1, t]).standard_normal((4, 12), dtype=np.float32)
        params, opt_state, outbox = step(engine.ticket(t), params, opt_state, jax.device_put(data[:, :8], batch),
                                         jax.device_put(data[:, 8:], batch), extras(t)["step"])
        if outbox is not None:
            engine.submit(t, outbox)
        if (t + 1) % 4 == 0:
            refs[t + 1] = jax.device_get((params, opt_state))
    assert params["b1"].sharding.spec != P(), params["b1"].sharding  # the premise: a leaf moved
    return engine, sink, refs

engine, sink, refs = run(replan=False)  # planned once, on the state before the first step
engine.wait_until_finished()
check_windows(sink, refs)
engine, sink, refs = run(replan=True)  # plan_for at phase 0 of every window, as the manager does
engine.wait_until_finished()
check_windows(sink, refs)
print("MOVED-OK")
'''


def test_a_leaf_moved_after_planning_is_still_captured_as_planned():
    """With the engine, a plan made before the first step of a jit without out_shardings
    expects a replicated bias that the step shards: the window steps copy every piece in the
    planned layout all the same (the host copies are pinned to it), so every checkpoint is
    bitwise (it was a broadcasting TypeError from the replay, then a WindowAborted); planned
    again at phase 0 of each window, as the manager does, too."""
    code = "import sys; sys.path.insert(0, %r)\n" % os.path.join(REPO, "tests") + MOVED_CODE
    result = run_python(code, devices=2)
    assert "MOVED-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]


LAYOUTS = r'''
import jax, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from conftest import make_params, run_loop, check_windows
mesh = Mesh(np.array(jax.devices()), ("data",))
shapes = [(64, 8), (6, 12), (40,), (8, 3)]
def place(spec):
    return lambda tree: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), tree)
rows = lambda x: P("data") if np.ndim(x) and np.shape(x)[0] % 4 == 0 else P()
for name, shard, place_state in (
        # jax.jit(tx.init) on FSDP parameters: XLA replicates the moments
        ("jit-created", place(rows), None),
        # ZeRO-1: parameters replicated, moments sharded on their rows
        ("zero1", place(lambda x: P()), place(rows))):
    for tx in (optax.adam(1e-2), optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))):
        engine, sink, refs = run_loop(tx, make_params(shapes), window=3, interval=4, steps=12,
                                      shard=shard, place_state=place_state)
        check_windows(sink, refs)
        plan = engine.plan
        # One layout per unit, the finer one: the (64, 8) kernel and its moments are captured
        # on their rows, so the elementwise update keeps row chunks.
        assert plan.chunked, name
        owned = plan.analysis.owned_state(0)
        assert owned and all(plan.state[j].sharding == plan.params[0].sharding for j in owned), name
        assert plan.params[0].sharding.spec == P("data"), (name, plan.params[0].sharding)
print("LAYOUTS-OK")
'''


def test_moments_laid_out_otherwise_than_their_parameters():
    """A state created under jax.jit (replicated moments of sharded parameters) and ZeRO-1
    (sharded moments of replicated parameters) are captured unit by unit in one layout and
    replayed bitwise against a synchronous snapshot."""
    code = "import sys; sys.path.insert(0, %r)\n" % os.path.join(REPO, "tests") + LAYOUTS
    result = run_python(code, devices=4)
    assert "LAYOUTS-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]
