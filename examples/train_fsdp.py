"""Train a Flax Linen transformer LM FSDP-style on many processes, with local and durable checkpoints.

    # CPU, one machine: this script starts 2 processes x 2 devices itself (< 1 min)
    python examples/train_fsdp.py --processes 2 --devices-per-process 2 --steps 60 --interval 20 --local-every 5
    # GPU cluster with SLURM: one process per GPU, each started by srun
    srun --nodes 4 --ntasks-per-node 8 --gpus-per-task 1 python examples/train_fsdp.py --platform gpu \\
        --model 1b --batch-size 64 --dir /lustre/ckpt/fsdp-run --interval 500 --local-every 50
    # TPU pod: the same command on every worker
    gcloud compute tpus tpu-vm ssh my-pod --worker=all --command "python examples/train_fsdp.py \\
        --platform tpu --model 1b --batch-size 256 --dir gs://my-bucket/fsdp-run --interval 500"
    # Kubernetes (Indexed Job) or by hand: say who is who
    python examples/train_fsdp.py --platform gpu --processes "$WORLD_SIZE" --process-id "$JOB_COMPLETION_INDEX" \\
        --coordinator trainer-0.trainer:1234 --dir gs://my-bucket/fsdp-run
    # One GPU host, one process driving all its GPUs
    python examples/train_fsdp.py --platform gpu --processes 1 --model 100m

Without --processes on a GPU or TPU the launcher (srun, the TPU runtime, Kubernetes, mpirun)
starts every process and `jax.distributed.initialize()`, with no arguments, reads from its
environment how many there are and which one this is (docs/multihost.md).

Kill it at any point (all of it: Ctrl-C, `kill -9 -<process group>`; or lose a host) and run the
same command again: it resumes from the newest step every process can restore.

Why it is written this way:
* One mesh axis, "fsdp", over every device of every process. A large leaf is split on its
  first axis divisible by the number of devices; XLA gathers a parameter where the step uses it
  and reduce-scatters its gradient, from the shardings alone (no collective in the model code).
* Leaves under 2**12 elements (16 KiB in float32: biases, LayerNorm scales, step counters) are
  replicated: splitting them saves no memory worth a collective's latency. The rule goes by
  shape, so Adam's moments lie exactly as their parameters and the update needs no traffic.
* The state is created under `jax.jit(create, out_shardings=...)`: each device computes its own
  blocks and no host ever holds the whole state.
* The step has `in_shardings`/`out_shardings` equal to the state's, and donates it: the state keeps
  one layout from step to step (XLA would otherwise move leaves, and a resumed run would run
  other programs than the uninterrupted one) and its buffers are reused in place.
* Each process feeds only its rows of the batch (`jax.make_array_from_process_local_data`).
  Here they are cut from one deterministic global batch; a real loader reads only its own.
* Checkpoints: every process writes only its own shards. `--local-every` steps to node memory
  (tmpfs, /dev/shm unless --local-dir), cheap enough to take often; every `--interval` steps
  to the durable directory, which every process must see (shared filesystem, gs://, s3://).
  With several processes each also holds its neighbour's local steps (`replicas=1`), so a
  replaced host, its /dev/shm empty, still resumes from the local tier.
* The restore target is the freshly created sharded state: each process reads only its
  blocks, straight onto the training layout.
"""

from __future__ import annotations

import functools
import os
import sys

from _common import launch_local_processes, parse_args


def add_options(ap):
    ap.add_argument("--processes", type=int,
                    help="on CPU: start this many processes of one job here; with --process-id: the job's "
                         "process count; 1: a single process (no jax.distributed); default: the launcher's")
    ap.add_argument("--process-id", type=int, help="this process's index (with --processes and --coordinator)")
    ap.add_argument("--coordinator", help="host:port of process 0's coordination service "
                                          "(default: $JAX_COORDINATOR_ADDRESS)")
    ap.add_argument("--devices-per-process", type=int, help="CPU devices per process (default 1)")
    ap.add_argument("--local-dir", help="node-local directory of the local tier (default: under /dev/shm)")
    ap.add_argument("--local-every", type=int, default=10, help="local checkpoint every N steps")

args = parse_args(__doc__.splitlines()[0], "ckpt_train_fsdp", add_options)
if (args.processes or 1) > 1 and args.process_id is None:
    if args.platform != "cpu":
        sys.exit("--processes N without --process-id starts N CPU processes; on a GPU or TPU cluster "
                 "the launcher starts them (see the docstring)")
    sys.exit(launch_local_processes(args.processes))
if args.platform == "cpu" and args.devices_per_process:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices_per_process}")

import jax  # noqa: E402  (after the platform and the device count are chosen)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import overlap_ckpt as oc  # noqa: E402
from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, TransformerLM, linen_init, linen_loss_fn  # noqa: E402


def start_distributed() -> None:
    if args.process_id is not None:  # started by --processes here, or by hand
        if args.platform == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.processes, args.process_id)
    elif args.platform != "cpu" and args.processes != 1:
        jax.distributed.initialize()  # SLURM, TPU pods, Kubernetes, MPI: from the environment


MIN_SHARDED_SIZE = 2**12  # elements; smaller leaves are replicated


def fsdp_sharding(mesh: Mesh, leaf) -> NamedSharding:
    """Split a large leaf on its first axis divisible by the mesh; replicate the rest."""
    n = mesh.size
    if leaf.size >= MIN_SHARDED_SIZE:
        for axis, dim in enumerate(leaf.shape):
            if dim % n == 0:
                return NamedSharding(mesh, P(*[None] * axis, "fsdp"))
    return NamedSharding(mesh, P())


def global_batch(data: SyntheticTokens, step: int, sharding: NamedSharding) -> dict[str, jax.Array]:
    """The batch of ``step`` as global arrays, each process giving only the rows its devices hold."""
    tokens = data.batch(step)["tokens"]
    rows = [index[0] for index in sharding.addressable_devices_indices_map(tokens.shape).values()]
    mine = tokens[min(r.start for r in rows):max(r.stop for r in rows)]
    return {"tokens": jax.make_array_from_process_local_data(sharding, mine, tokens.shape)}


def main() -> None:
    start_distributed()
    log = print if jax.process_index() == 0 else (lambda *a, **k: None)
    config = LMConfig.preset(args.model)
    if args.batch_size % jax.device_count():
        sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {jax.device_count()} devices")
    data = SyntheticTokens(config.vocab_size, config.seq_len, args.batch_size, seed=args.seed)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    batch_sharding, replicated = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
    model = TransformerLM(config)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01))

    def create():
        return oc.TrainState.create(apply_fn=model.apply, params=linen_init(config, args.seed), tx=tx)

    shardings = jax.tree.map(lambda leaf: fsdp_sharding(mesh, leaf), jax.eval_shape(create))
    state = jax.jit(create, out_shardings=shardings)()

    @functools.partial(jax.jit, in_shardings=(shardings, batch_sharding), out_shardings=(shardings, replicated),
                       donate_argnums=0)
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    local = oc.LocalTier(args.local_dir, every=args.local_every, max_to_keep=2,
                         replicas=1 if jax.process_count() > 1 else 0)
    with oc.CheckpointManager(args.dir, save_interval_steps=args.interval, max_to_keep=args.max_to_keep,
                              window=args.window, local=local) as mngr:
        # Every process must take the same branch: a replaced host may see no step of its own.
        if multihost_utils.process_allgather(np.int32(mngr.latest_step() is not None)).any():
            state = mngr.restore(target_state=state)
            log(f"resumed from step {int(state.step)}")
        else:
            state = mngr.prepare(state)
        start = int(state.step)
        # The K window variants of the step compile in the background while plain steps run.
        mngr.compile_ahead(train_step, state, global_batch(data, start, batch_sharding))
        for step in range(start, args.steps):
            batch = global_batch(data, step, batch_sharding)
            state, loss = train_step(state, batch)
            state = mngr.step(state)
            if step % 20 == 0 or step == args.steps - 1:
                log(f"step {step:5d}  loss {float(loss):.4f}")
        mngr.wait_until_finished()
        log(f"done: {args.steps} steps on {jax.device_count()} {jax.default_backend()} device(s) in "
            f"{jax.process_count()} process(es); checkpoints {mngr.all_steps()}")


if __name__ == "__main__":
    main()
