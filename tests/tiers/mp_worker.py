"""One process of the local tier's multi-process tests (jax.distributed + gloo on 127.0.0.1).

The reliability suite's MLP (tests/faults/worker.py), FSDP over the job's devices (one per
process): every parameter split over the ``data`` axis, the step replicated. Trained
through ``CheckpointManager(local=LocalTier(<local>, every=2))``, durable every 6 steps; each
process's local tier is ``<local>/process_<i>``. ``--resume`` restores the newest step
complete everywhere (the processes agree) onto the training shardings. ``--replicas R``:
each process also holds R peers' local steps. Faults at the end of step ``T``, once every
checkpoint handed over so far is written and replicated on every process (the window of
the next local step is open): ``--kill-at T`` (process 1 SIGKILLs itself; the others go
on), ``--preempt-at T`` (every process gets SIGTERM, with ``overlap_ckpt.preemption``
installed).

stdout: JSON lines ``resumed`` (step), ``step`` (loss bits), ``done``.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from e2e.mp_compile_cache import cache_compiles_of_every_process  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
cache_compiles_of_every_process()

from faults.worker import _loss, batch, emit, loss_bits, make_state  # noqa: E402
from tiers.worker import EVERY, INTERVAL, KEEP, WINDOW  # noqa: E402

SPECS = {"dense1": {"kernel": (None, "data"), "bias": ("data",)}, "dense2": {"kernel": ("data", None), "bias": ("data",)}}


def sharded_state(mesh):
    """make_state()'s values, params and optimizer moments placed by SPECS on ``mesh``."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    host = make_state()
    by_leaf = jax.tree.map(lambda spec: NamedSharding(mesh, P(*spec)), SPECS,
                           is_leaf=lambda x: isinstance(x, tuple))
    replicated = NamedSharding(mesh, P())

    def place(path, x):
        names = [getattr(k, "key", None) for k in path]
        for layer in SPECS:
            if layer in names:
                sharding = by_leaf[layer][names[names.index(layer) + 1]]
                break
        else:
            sharding = replicated
        value = jax.device_get(x)
        return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    step = jax.numpy.int32(0)
    state = host.replace(step=step)
    return jax.tree_util.tree_map_with_path(place, state)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--local", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--window", type=int, default=WINDOW)
    ap.add_argument("--replicas", type=int, default=0)
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--preempt-at", type=int)
    args = ap.parse_args()
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.nprocs,
                               process_id=args.pid, initialization_timeout=30, heartbeat_timeout_seconds=60)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import overlap_ckpt as oc
    from overlap_ckpt.storage.coordination import distributed_client

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, P())

    with oc.CheckpointManager(args.dir, save_interval_steps=INTERVAL, window=args.window, max_to_keep=KEEP,
                              local=oc.LocalTier(args.local, every=EVERY, max_to_keep=KEEP,
                                                 replicas=args.replicas)) as mngr:
        fresh = sharded_state(mesh)
        if args.preempt_at is not None:
            from overlap_ckpt import preemption
            preemption.install(mngr, deadline_s=60)

        # The state keeps its shardings from step to step, as an FSDP loop declares them.
        @functools.partial(jax.jit, out_shardings=(jax.tree.map(lambda x: x.sharding, fresh), replicated),
                           donate_argnums=0)
        def train_step(state, x, y):
            loss, grads = jax.value_and_grad(_loss)(state.params, x, y)
            return state.apply_gradients(grads=grads), loss

        state = mngr.restore(target_state=fresh) if args.resume else mngr.prepare(fresh)
        start = int(state.step)
        emit(ev="resumed", step=start, pid=args.pid)
        for t in range(start, args.steps):
            x, y = (jax.device_put(a, replicated) for a in batch(0, t))
            state, loss = train_step(state, x, y)
            state = mngr.step(state)
            emit(ev="step", t=t, loss=loss_bits(np.asarray(loss.addressable_shards[0].data)))
            if t in (args.kill_at, args.preempt_at):
                mngr.wait_until_finished()
                distributed_client().wait_at_barrier("tiers_mp_worker:fault", 60_000)
                if t == args.preempt_at:
                    os.kill(os.getpid(), signal.SIGTERM)
                elif args.pid == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
    distributed_client().wait_at_barrier("tiers_mp_worker:done", 60_000)
    emit(ev="done", pid=args.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
