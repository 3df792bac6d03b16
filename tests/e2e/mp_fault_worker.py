"""One process of the 2-process fault runs of tests/e2e/test_multiprocess.py.

Trains the sharded toy state of :mod:`mp_worker` (the same jitted, capturing step) for
``--steps`` steps with a checkpoint every ``INTERVAL`` steps through a ``CheckpointStore``
whose barriers time out after ``--timeout`` seconds; with ``--resume`` it first restores the
newest committed step onto the training shardings and continues from there.

* ``--refs``: process 0 writes ``<out>/refs.npz``, the gathered state at every checkpoint
  version (a synchronous snapshot: the independent reference).
* ``--kill-pid P --kill-stage S --kill-step N --kill-delay D``: process P, once training is
  over (so that only the checkpoint is hit, not the step's collectives), SIGKILLs itself
  ``D`` seconds after its persist of step ``N`` reached storage stage ``S``: a random
  point of the write, the barriers or the commit. It prints ``FAULT_FIRED`` first.

Every surviving process writes ``<out>/result_<pid>.json`` (start step, the persist error
it got, if any) and prints ``WORKER-OK <pid>``.
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
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mp_worker import FAULT_FIRED, INTERVAL, WINDOW, sharded_state, toy_loss, tx

# Written by the armed process right before it dies. The survivor waits for it before
# exiting: when the kill lands after the checkpoint (a long delay), a survivor that exits
# first would take jax.distributed's service down and abort the armed process (SIGABRT).
VICTIM_DIED = "victim_died"


def wait_for_victim(args) -> None:
    path = os.path.join(args.out, VICTIM_DIED)
    for _ in range(int(args.timeout * 40)):
        if os.path.exists(path):
            return
        threading.Event().wait(0.1)


def arm_kill(args, trained: threading.Event) -> None:
    from overlap_ckpt.storage import set_fault_hook

    def die():
        open(os.path.join(args.out, VICTIM_DIED), "w").close()
        print(FAULT_FIRED, args.kill_stage, args.kill_step, args.kill_delay, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(stage, info):
        if stage == args.kill_stage and info.get("step") == args.kill_step:
            trained.wait(120)
            threading.Timer(args.kill_delay, die).start()

    set_fault_hook(hook)


def run(args) -> None:
    from jax.experimental import multihost_utils
    from overlap_ckpt import OverlapEngine, capture_update
    from overlap_ckpt.storage import CheckpointError, CheckpointStore
    from overlap_ckpt.storage.coordination import JaxDistributedCoordinator

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                               process_id=args.pid, initialization_timeout=30,
                               heartbeat_timeout_seconds=120)
    pid = jax.process_index()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, opt_state = sharded_state(mesh)
    replicated = NamedSharding(mesh, P())
    # "block": every checkpoint is persisted (the engine waits, not training), so which
    # steps exist at the kill is known.
    store = CheckpointStore(args.dir, coordinator=JaxDistributedCoordinator(timeout_s=args.timeout),
                            on_backpressure="block")
    start = 0
    if args.resume:
        start = store.latest_step()
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              {"params": params, "opt_state": opt_state})
        target["extras"] = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)}
        back, _ = store.restore(start, target)
        params, opt_state = back["params"], back["opt_state"]
    trained = threading.Event()
    if args.kill_pid == pid:
        arm_kill(args, trained)

    optimizer = tx()
    engine = OverlapEngine(optimizer, store, interval=INTERVAL, window=WINDOW)
    engine.plan_for(params, opt_state, {"step": jax.device_put(jnp.int32(0), replicated)})
    engine.start(start)

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def train_step(ticket, params, opt_state, x, t):
        grads = jax.grad(toy_loss)(params, x)
        return capture_update(optimizer, ticket, params, opt_state, grads, {"step": t}, step=t)

    refs = {}
    for t in range(start, args.steps):
        params, opt_state, outbox = train_step(engine.ticket(t), params, opt_state,
                                               jnp.float32(0.1 + 0.01 * t), jnp.int32(t))
        if outbox is not None:
            engine.submit(t, outbox)
        if args.refs and (t + 1) % INTERVAL == 0:
            gathered = multihost_utils.process_allgather((params, opt_state), tiled=True)
            refs.update({f"v{t + 1}_{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(gathered))})
    engine.wait_until_finished()
    engine.close()
    trained.set()  # the armed process dies in its persist from now on
    result = {"pid": pid, "start": start}
    try:
        store.wait_until_finished()
    except CheckpointError as e:
        result.update(error=str(e), error_type=type(e).__name__, step=e.step,
                      cause_type=type(e.__cause__).__name__, missing=getattr(e.__cause__, "missing", None))
    if args.kill_pid == pid:  # the timer kills this process; reaching here means it did not
        threading.Event().wait(args.timeout * 4)
        raise AssertionError("the armed process was not killed")
    if refs and pid == 0:
        np.savez(os.path.join(args.out, "refs.npz"), **refs)
    with open(os.path.join(args.out, f"result_{pid}.json"), "w") as f:
        json.dump(result, f)
    if args.kill_pid >= 0:
        wait_for_victim(args)
    print(f"WORKER-OK {pid}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--refs", action="store_true")
    ap.add_argument("--kill-pid", type=int, default=-1)
    ap.add_argument("--kill-stage", default="data_written")
    ap.add_argument("--kill-step", type=int, default=-1)
    ap.add_argument("--kill-delay", type=float, default=0.0)
    run(ap.parse_args())
    sys.stdout.flush()
    os._exit(0)  # the dead peer would make jax.distributed's shutdown wait


if __name__ == "__main__":
    main()
