"""One process of the 2-process FSDP loop without ``out_shardings`` (tests/e2e/test_multiprocess.py).

Kernels sharded over every device of the job, biases replicated, the batch sharded, and a
``jax.jit`` step without ``out_shardings``: XLA shards the biases and their moments from the
first step on, so each window must be planned on the state as the step placed it. Trained
through ``CheckpointManager`` (K=2, a checkpoint every 4 steps); each checkpoint, restored
onto the final state's shardings, must equal this process's shards of a synchronous
snapshot bitwise. Prints "PLACEMENT-OK <process>" at the end.
"""

from __future__ import annotations

import argparse
import functools

import jax

from mp_compile_cache import cache_compiles_of_every_process

jax.config.update("jax_cpu_collectives_implementation", "gloo")
cache_compiles_of_every_process()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

INTERVAL, WINDOW, STEPS = 4, 2, 9


def loss(params, x, y):
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return jnp.mean((h @ params["dense2"]["kernel"] + params["dense2"]["bias"] - y) ** 2)


def shards(tree) -> list[dict]:
    """This process's distinct blocks of every leaf, by index, as numpy."""
    return [{tuple((s.start, s.stop) for s in sh.index): np.array(sh.data) for sh in x.addressable_shards
             if sh.replica_id == 0} for x in jax.tree.leaves(tree)]


def main() -> None:
    import overlap_ckpt as oc

    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.nprocs,
                               process_id=args.pid, initialization_timeout=30, heartbeat_timeout_seconds=60)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    specs = {"dense1": {"kernel": P(None, "data"), "bias": P()}, "dense2": {"kernel": P("data", None), "bias": P()}}
    rng = np.random.default_rng(0)
    params = {}
    for layer, kernel in (("dense1", (8, 16)), ("dense2", (16, 4))):
        params[layer] = {}
        for name, shape in (("kernel", kernel), ("bias", kernel[1:])):
            value = rng.standard_normal(shape, dtype=np.float32) * 0.3
            params[layer][name] = jax.make_array_from_callback(
                shape, NamedSharding(mesh, specs[layer][name]), lambda index, v=value: v[index])

    @functools.partial(jax.jit, donate_argnums=0)  # no out_shardings
    def step(state, x, y):
        grads = jax.grad(loss)(state.params, x, y)
        return state.apply_gradients(grads=grads)

    def batch(t):
        data = np.random.default_rng([1, t]).standard_normal((8, 12), dtype=np.float32)
        sharding = NamedSharding(mesh, P("data"))
        return [jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
                for a in (data[:, :8], data[:, 8:])]

    snapshots = {}
    with oc.CheckpointManager(args.dir, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        state = mngr.prepare(oc.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2)))
        for t in range(STEPS):
            state = mngr.step(step(state, *batch(t)))
            if mngr.should_save(t + 1):
                snapshots[t + 1] = shards((state.params, state.opt_state))
        # The premise: the step placed a replicated leaf otherwise than prepare saw it.
        assert state.params["dense1"]["bias"].sharding.spec != P(), state.params["dense1"]["bias"].sharding
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8] and not mngr.failed_steps(), (mngr.all_steps(), mngr.failed_steps())
        for version, want in snapshots.items():
            restored = mngr.restore(version, target_state=state)
            got = shards((restored.params, restored.opt_state))
            for i, (g, w) in enumerate(zip(got, want)):
                assert g.keys() == w.keys(), (version, i, g.keys(), w.keys())
                for key in w:
                    assert g[key].dtype == w[key].dtype and g[key].tobytes() == w[key].tobytes(), (version, i, key)
    print(f"PLACEMENT-OK {args.pid}", flush=True)


if __name__ == "__main__":
    main()
