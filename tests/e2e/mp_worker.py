"""One process of the multi-process tests (tests/test_multiprocess.py); also a restorer.

Modes:
  train    one of N processes (jax.distributed + gloo): train a small sharded state with
           in-graph capture, the engine and a CheckpointStore sink (K=2); check this process's
           replayed shards against its synchronous snapshot shards; write the gathered
           reference (process 0) to <out>/ref.npz.
  kill     like train, but process 1 SIGKILLs itself in the middle of persisting step 6;
           process 0 must time out with an error naming process 1, commit nothing, and
           still restore step 3.
  restore  a single process (no jax.distributed): restore the committed checkpoint onto
           this process's devices and compare it bitwise with <out>/ref.npz.
Prints "WORKER-OK <mode> <process>" at the end on success.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys
import threading

import jax

from mp_compile_cache import cache_compiles_of_every_process

jax.config.update("jax_cpu_collectives_implementation", "gloo")
cache_compiles_of_every_process()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

SHAPES = {"w000": (16, 6), "w001": (8, 4), "w002": (7,)}
SPECS = {"w000": P("data"), "w001": P(None, "data"), "w002": P()}  # w002: replicated everywhere
INTERVAL, WINDOW, STEPS = 3, 2, 8  # windows end at versions 3 and 6
FAULT_FIRED = "FAULT-HOOK-FIRED"  # tests/e2e/test_multiprocess.py looks for it


def tx():
    return optax.adam(1e-2)


def global_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in SHAPES.items()}


def toy_loss(params, x):
    return sum(jnp.sum(jnp.sin(v * x) ** 2) for v in jax.tree.leaves(params))


def sharded_state(mesh):
    host = global_params()
    params = {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, SPECS[k]),
                                              lambda idx, v=v: v[idx])
              for k, v in host.items()}
    def sharding_of(path, _):  # mu/nu like their parameter, the count replicated
        name = getattr(path[-1], "key", None) if path else None
        return NamedSharding(mesh, SPECS.get(name, P()))
    shardings = jax.tree_util.tree_map_with_path(sharding_of, jax.eval_shape(tx().init, params))
    opt_state = jax.jit(tx().init, out_shardings=shardings)(params)
    return params, opt_state


def local_blocks(x: jax.Array) -> dict[tuple, np.ndarray]:
    from overlap_ckpt.hostarray import normalize_index
    return {tuple((s.start, s.stop) for s in normalize_index(sh.index, x.shape)): np.asarray(sh.data)
            for sh in x.addressable_shards if sh.replica_id == 0}


def bits_equal(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


class TeeSink:
    """Keeps what the engine hands over (to check it) and persists it."""

    def __init__(self, store):
        self.store, self.saved = store, {}

    def put(self, step, tree, metadata=None):
        self.saved[step] = tree
        self.store.put(step, tree, metadata)

    def busy_steps(self):
        return self.saved.keys()  # kept for the checks: never reused


def train(args) -> dict:
    from jax.experimental import multihost_utils
    from overlap_ckpt import HostArray, OverlapEngine, capture_update
    from overlap_ckpt.storage.coordination import JaxDistributedCoordinator, distributed_client
    from overlap_ckpt.storage import CheckpointError, CheckpointStore, set_fault_hook

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.nprocs, process_id=args.pid,
                               initialization_timeout=30, heartbeat_timeout_seconds=60)
    pid = jax.process_index()
    assert jax.process_count() == args.nprocs and jax.device_count() == 2 * args.nprocs
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, opt_state = sharded_state(mesh)

    store = CheckpointStore(args.dir, coordinator=JaxDistributedCoordinator(timeout_s=args.timeout))
    default = CheckpointStore(args.dir, read_only=True)  # default coordinator: picked by itself
    assert type(default._coord).__name__ == "JaxDistributedCoordinator", default._coord
    default.close()

    killed = threading.Event()
    if args.mode == "kill" and pid == 1:
        def hook(stage, info):
            # Mid-persist of step 6: this process's data is written, the barrier not reached.
            if stage == "data_written" and info.get("step") == 6:
                killed.wait(60)
                print(FAULT_FIRED, flush=True)  # the test tells this kill from its own
                os.kill(os.getpid(), signal.SIGKILL)
        set_fault_hook(hook)

    sink = TeeSink(store)
    optimizer = tx()
    engine = OverlapEngine(optimizer, sink, interval=INTERVAL, window=WINDOW)
    # extras live on the mesh too (replicated): a single-device leaf would pin the step to one device
    plan = engine.plan_for(params, opt_state,
                           {"step": jax.device_put(jnp.int32(0), NamedSharding(mesh, P()))})
    assert plan.k == WINDOW, plan.k

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def train_step(ticket, params, opt_state, x, t):
        grads = jax.grad(toy_loss)(params, x)
        return capture_update(optimizer, ticket, params, opt_state, grads, {"step": t}, step=t)

    local_refs, global_refs = {}, {}
    for t in range(STEPS):
        params, opt_state, outbox = train_step(engine.ticket(t), params, opt_state,
                                               jnp.float32(0.1 + 0.01 * t), jnp.int32(t))
        if outbox is not None:
            engine.submit(t, outbox)
        if (t + 1) % INTERVAL == 0 and t + 1 < STEPS:
            state = (params, opt_state)
            local_refs[t + 1] = [local_blocks(x) for x in jax.tree.leaves(state)]
            global_refs[t + 1] = [np.asarray(x) for x in jax.tree.leaves(
                multihost_utils.process_allgather(state, tiled=True))]
    engine.wait_until_finished()
    engine.close()
    distributed_client().wait_at_barrier("mp_worker:trained", 30_000)

    # 1. Replayed shards == synchronous snapshot shards, bitwise, per process.
    assert sorted(sink.saved) == sorted(local_refs) == [3, 6], sorted(sink.saved)
    for version, refs in local_refs.items():
        tree = sink.saved[version]
        got = jax.tree.leaves((tree["params"], tree["opt_state"]),
                              is_leaf=lambda x: isinstance(x, HostArray))
        assert len(got) == len(refs)
        for i, (host, want) in enumerate(zip(got, refs)):
            have = {tuple((s.start, s.stop) for s in sh.index): sh.data for sh in host.shards}
            assert sorted(have) == sorted(want), (version, i, sorted(have), sorted(want))
            for key, data in want.items():
                assert bits_equal(have[key], data), f"process {pid} version {version} leaf {i} block {key}"
        # The replicated step counter is held (and written) by process 0 only, at the version.
        step_shards = tree["extras"]["step"].shards
        assert len(step_shards) == (1 if pid == 0 else 0), (pid, len(step_shards))
        assert all(int(np.asarray(sh.data)) == version for sh in step_shards), version
    # 2. The replicated leaf is held (and so written) by exactly one process.
    w002 = sink.saved[3]["params"]["w002"]
    replicated_shards = len(w002.shards)
    owned_bytes = {v: sum(x.nbytes for x in jax.tree.leaves(
        sink.saved[v], is_leaf=lambda x: isinstance(x, HostArray))) for v in sink.saved}

    result = {"pid": pid, "replicated_shards": replicated_shards, "owned_bytes": owned_bytes[3]}
    if args.mode == "train":
        store.wait_until_finished()
        distributed_client().wait_at_barrier("mp_worker:persisted", 30_000)
        assert store.all_steps() == [3, 6], store.all_steps()
        # Restore in the same 2-process job onto the training shardings: own shards back.
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              {"params": params, "opt_state": opt_state})
        target["extras"] = {"step": jax.ShapeDtypeStruct((), jnp.int32,
                                                         sharding=NamedSharding(mesh, P()))}
        back, _ = store.restore(6, target)
        for x, ref in zip(jax.tree.leaves((back["params"], back["opt_state"])), local_refs[6]):
            blocks = local_blocks(x)
            assert sorted(blocks) == sorted(ref)
            assert all(bits_equal(blocks[k], ref[k]) for k in ref)
        # 3. A checkpoint written by a different number of processes, target=None: clear error.
        with CheckpointStore(args.single_dir, read_only=True) as other:
            try:
                other.restore()
            except CheckpointError as e:
                result["numpy_restore_error"] = str(e)
            else:
                raise AssertionError("restore(target=None) across a process-count change succeeded")
        if pid == 0:
            np.savez(os.path.join(args.out, "ref.npz"),
                     **{f"v{v}_{i}": a for v, leaves in global_refs.items() for i, a in enumerate(leaves)})
        store.close()
    else:  # kill
        killed.set()  # process 1: the hook now kills this process in the persist thread
        if pid == 1:  # the hook kills this process; if it never fires, fail (exit 1, not -9)
            try:
                store.wait_until_finished()
            finally:
                raise AssertionError("process 1 was not killed by its fault hook")
        try:
            store.wait_until_finished()
        except CheckpointError as e:
            result["error"] = str(e)
            result["error_type"] = type(e).__name__
            result["cause_type"] = type(e.__cause__).__name__
            result["missing"] = getattr(e.__cause__, "missing", None)
        else:
            raise AssertionError("process 0 did not notice that process 1 died")
        result["all_steps"] = store.all_steps()
        result["incomplete_steps"] = store.incomplete_steps()
        back, _ = store.restore(3)  # numpy: written by as many processes as this job has
        for i, (a, b) in enumerate(zip(jax.tree.leaves((back["params"], back["opt_state"])),
                                       global_refs[3])):
            assert bits_equal(np.asarray(a), b), f"step 3 leaf {i}"
        result["restored_3"] = True
        with open(os.path.join(args.out, f"result_{pid}.json"), "w") as f:
            json.dump(result, f)
        print(f"WORKER-OK {args.mode} {pid}", flush=True)
        os._exit(0)  # the dead peer would make jax.distributed's shutdown wait
    with open(os.path.join(args.out, f"result_{pid}.json"), "w") as f:
        json.dump(result, f)
    distributed_client().wait_at_barrier("mp_worker:done", 30_000)
    print(f"WORKER-OK {args.mode} {pid}", flush=True)
    return result


def restore(args) -> None:
    from overlap_ckpt.storage import CheckpointStore

    ref = np.load(os.path.join(args.out, "ref.npz"))
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    params, opt_state = sharded_state(mesh)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {"params": params, "opt_state": opt_state})
    target["extras"] = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))}
    with CheckpointStore(args.dir, read_only=True) as store:
        assert store.all_steps() == [3, 6], store.all_steps()
        for version in (3, 6):
            back, _ = store.restore(version, target)
            leaves = jax.tree.leaves((back["params"], back["opt_state"]))
            for i, x in enumerate(leaves):
                assert x.sharding == jax.tree.leaves(
                    (target["params"], target["opt_state"]))[i].sharding
                assert bits_equal(np.asarray(x), ref[f"v{version}_{i}"]), f"v{version} leaf {i}"
            assert int(back["extras"]["step"]) == version
            numpy_tree, _ = store.restore(version)  # single process: numpy without target is fine
            for i, a in enumerate(jax.tree.leaves((numpy_tree["params"], numpy_tree["opt_state"]))):
                assert bits_equal(np.asarray(a), ref[f"v{version}_{i}"]), f"numpy v{version} leaf {i}"
        assert store.verify().ok
    print(f"WORKER-OK restore {len(devices)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "kill", "restore"])
    ap.add_argument("--pid", type=int, default=0)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--single-dir", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    if args.mode == "restore":
        restore(args)
    else:
        train(args)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown races of the distributed client's threads


if __name__ == "__main__":
    main()
