"""Train a Flax NNX transformer LM with overlapped checkpoints, resuming if possible.

    python examples/train_nnx.py                                  # CPU, tiny model, < 1 min
    python examples/train_nnx.py --platform tpu --model 1b --batch-size 64 \\
        --dir gs://my-bucket/nnx-run --interval 100

Kill it at any point and run it again: it resumes from the latest committed checkpoint.
"""

from __future__ import annotations

from _common import data_mesh, parse_args

args = parse_args(__doc__.splitlines()[0], "ckpt_train_nnx")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import overlap_ckpt as oc  # noqa: E402
from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, nnx_init, nnx_loss_fn  # noqa: E402


@nnx.jit(donate_argnums=(0, 1))  # the model before the optimizer (see docs/nnx.md)
def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(nnx_loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    config = LMConfig.preset(args.model)
    data = SyntheticTokens(config.vocab_size, config.seq_len, args.batch_size, seed=args.seed)
    mesh, replicated, batch_sharding = data_mesh()
    model = nnx_init(config, seed=args.seed)
    optimizer = oc.nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)
    nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), replicated))

    with oc.CheckpointManager(args.dir, save_interval_steps=args.interval, max_to_keep=args.max_to_keep,
                              window=args.window) as mngr:
        if mngr.latest_step() is not None:
            mngr.restore(target_state=optimizer, model=model)
            print(f"resumed from step {int(optimizer.step[...])} in {args.dir}")
        else:
            mngr.prepare(optimizer, model)
        start = int(optimizer.step[...])
        for step in range(start, args.steps):
            batch = jax.device_put(data.batch(step), batch_sharding)
            loss = train_step(model, optimizer, batch)
            mngr.step(optimizer)
            if step % 20 == 0 or step == args.steps - 1:
                print(f"step {step:5d}  loss {float(loss):.4f}")
        mngr.wait_until_finished()
        print(f"done: {args.steps} steps on {jax.device_count()} {jax.default_backend()} device(s); "
              f"checkpoints {mngr.all_steps()} in {args.dir}")


if __name__ == "__main__":
    main()
