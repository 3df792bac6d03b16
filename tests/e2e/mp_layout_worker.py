"""One process of a multi-process job whose train state is laid out as a user's job lays it
out: any ``PartitionSpec`` per leaf, created eagerly or under ``jax.jit``, a step jitted
with or without ``out_shardings`` taken from the state (tests/e2e/test_layouts.py).

The case is one JSON argument (``--case``), see :func:`tests.e2e.layouts.Case`: the mesh,
a spec per parameter leaf and per non-scalar optimizer-state leaf, the optimizer chain,
how the state is created (``eager``: every leaf placed from host values; ``jit``: the
state created under ``jax.jit``, XLA lays out the optimizer state; ``jit_out``: under
``jax.jit`` with ``out_shardings`` from the specs) and how the step is jitted (``plain``:
``donate_argnums`` only; ``keep``: ``out_shardings`` taken from the state after
``prepare``/``restore``). Trained through ``CheckpointManager`` with a durable tier and
a local tier (``--replicas`` peers).

``--kill-at T``: at the end of step ``T`` (in a window), once every checkpoint handed over so
far is written (and replicated) on every process, every process SIGKILLs itself.
``--copy-at T --copy-to DIR``: at that same point, process 0 copies the durable and local
directories into ``DIR`` (what the SIGKILL would leave on disk), and the job goes on.
``--resume``: restore the newest step complete everywhere onto the creation's shardings.
stdout: JSON lines ``resumed`` (step), ``step`` (loss bits), ``done``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from mp_compile_cache import cache_compiles_of_every_process  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
cache_compiles_of_every_process()

from e2e.layouts import Case, batch, loss_fn, make_params  # noqa: E402
from faults.worker import emit, loss_bits  # noqa: E402


def as_the_step_leaves_it(train_step, state, example, replicated):
    """``state`` placed as the step's outputs are placed once they no longer move.

    Why: a step jitted without ``out_shardings`` lets XLA place its outputs, and it moved
    leaves after the first step (replicated parameters came back sharded like their
    moments). The uninterrupted job ran every later step on the moved layout; a restart
    that restores onto the creation's layout runs its first step on another program, whose
    result differs in the last bits. Restoring onto the layout the step settles on (what a
    user reads from the compiled step) resumes bitwise."""
    import jax

    x, y = (jax.device_put(a, replicated) for a in example)
    for _ in range(3):
        out = train_step.lower(state, x, y).compile().output_shardings[0]
        if all(a.sharding.is_equivalent_to(b, a.ndim) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(out))):
            return state
        state = jax.jit(lambda s: s, out_shardings=out)(state)
    return state


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--nprocs", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--local", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--case", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--copy-at", type=int)
    ap.add_argument("--copy-to")
    ap.add_argument("--snapshot-at", type=int, help="a synchronous snapshot of the state before this step")
    args = ap.parse_args()
    case = Case.from_json(args.case)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.nprocs,
                               process_id=args.pid, initialization_timeout=30, heartbeat_timeout_seconds=60)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import overlap_ckpt as oc
    from overlap_ckpt.storage.coordination import distributed_client

    mesh = case.mesh()
    replicated = NamedSharding(mesh, P())
    with oc.CheckpointManager(args.dir, save_interval_steps=case.durable_every, window=case.window, max_to_keep=2,
                              local=oc.LocalTier(args.local, every=case.local_every, max_to_keep=2,
                                                 replicas=case.replicas)) as mngr:
        fresh = case.create_state(make_params(), mesh)

        def make_step(**kwargs):
            @functools.partial(jax.jit, donate_argnums=0, **kwargs)
            def train_step(state, x, y):
                loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
                return state.apply_gradients(grads=grads), loss
            return train_step

        if args.resume and case.step == "plain":
            fresh = as_the_step_leaves_it(make_step(), fresh, batch(0), replicated)
        state = mngr.restore(target_state=fresh) if args.resume else mngr.prepare(fresh)
        train_step = make_step(out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated)) \
            if case.step == "keep" else make_step()
        start = int(state.step)
        emit(ev="resumed", step=start, pid=args.pid)
        for t in range(start, args.steps):
            x, y = (jax.device_put(a, replicated) for a in batch(t))
            phase = mngr.next_window_phase
            if t == args.snapshot_at:
                snapshot = multihost_utils.process_allgather((state.params, state.opt_state), tiled=True)
                if args.pid == 0:
                    np.savez(os.path.join(args.dir, "..", f"snapshot_{t}.npz"), *jax.tree.leaves(snapshot))
            state, loss = train_step(state, x, y)
            state = mngr.step(state)
            emit(ev="step", t=t, loss=loss_bits(np.asarray(loss.addressable_shards[0].data)), phase=phase)
            if t in (args.kill_at, args.copy_at):
                mngr.wait_until_finished()
                distributed_client().wait_at_barrier("layout_worker:written", 60_000)
                if t == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if args.pid == 0:
                    shutil.copytree(args.dir, os.path.join(args.copy_to, "durable"))
                    shutil.copytree(args.local, os.path.join(args.copy_to, "local"))
                distributed_client().wait_at_barrier("layout_worker:copied", 60_000)
    distributed_client().wait_at_barrier("layout_worker:done", 60_000)
    emit(ev="done", pid=args.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
