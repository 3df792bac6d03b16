"""Train a Flax Linen transformer LM with overlapped checkpoints, resuming if possible.

    python examples/train_lm.py                                   # CPU, tiny model, < 1 min
    python examples/train_lm.py --platform gpu --model 1b --batch-size 32 \\
        --dir gs://my-bucket/lm-run --interval 100 --window auto

Kill it at any point and run it again: it resumes from the latest committed checkpoint.
"""

from __future__ import annotations

from _common import data_mesh, parse_args

args = parse_args(__doc__.splitlines()[0], "ckpt_train_lm")

import functools  # noqa: E402  (after the platform is chosen)

import jax  # noqa: E402
import optax  # noqa: E402

import overlap_ckpt as oc  # noqa: E402
from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, TransformerLM, linen_init, linen_loss_fn  # noqa: E402


def main() -> None:
    config = LMConfig.preset(args.model)
    data = SyntheticTokens(config.vocab_size, config.seq_len, args.batch_size, seed=args.seed)
    mesh, replicated, batch_sharding = data_mesh()
    model = TransformerLM(config)
    state = oc.TrainState.create(apply_fn=model.apply, params=linen_init(config, args.seed),
                                 tx=optax.adamw(args.lr, weight_decay=0.01))
    state = jax.device_put(state, replicated)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    with oc.CheckpointManager(args.dir, save_interval_steps=args.interval, max_to_keep=args.max_to_keep,
                              window=args.window) as mngr:
        if mngr.latest_step() is not None:
            state = mngr.restore(target_state=state)
            print(f"resumed from step {int(state.step)} in {args.dir}")
        else:
            state = mngr.prepare(state)
        start = int(state.step)
        # The K window variants of the step compile in the background while plain steps run.
        mngr.compile_ahead(train_step, state, jax.device_put(data.batch(start), batch_sharding))
        for step in range(start, args.steps):
            batch = jax.device_put(data.batch(step), batch_sharding)
            state, loss = train_step(state, batch)
            state = mngr.step(state)
            if step % 20 == 0 or step == args.steps - 1:
                print(f"step {step:5d}  loss {float(loss):.4f}")
        mngr.wait_until_finished()
        print(f"done: {args.steps} steps on {jax.device_count()} {jax.default_backend()} device(s); "
              f"checkpoints {mngr.all_steps()} in {args.dir}")


if __name__ == "__main__":
    main()
