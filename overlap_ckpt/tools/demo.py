"""Training worker of ``overlap-ckpt demo``: ``python -m overlap_ckpt.tools.demo train ...``.

One process trains the tiny Flax Linen LM (adamw, synthetic data whose position is the step
number) the way a user would: ``overlap_ckpt.TrainState``, a donating jitted step, and
``overlap_ckpt.CheckpointManager.step`` after every step. With ``--resume`` it restores the
latest committed step first. Every run takes its checkpoint windows at the same steps, so an
uninterrupted run and a resumed one must produce bitwise identical losses.

The worker reports on stdout, one JSON object per line (flushed): ``step`` events (loss as
float32 bit pattern, step time, whether the step was in a window), ``commit`` events,
``wait`` (handshake: with ``--handshake`` the worker stops in the middle of a window, once
two checkpoints are committed, and reads a line from stdin before going on, so the parent
can SIGKILL it at a known point), and a final ``done``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time


def _emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _loss_bits(loss) -> int:
    import numpy as np

    return int(np.asarray(loss, dtype=np.float32).reshape(()).view(np.uint32))


def build(seed: int = 0, batch_size: int = 8):
    """A fresh train state, the data and the jitted, donating train step."""
    import jax
    import optax

    from .. import TrainState
    from .models import LMConfig, SyntheticTokens, TransformerLM, linen_init, linen_loss_fn

    config = LMConfig.preset("tiny")
    model = TransformerLM(config)
    data = SyntheticTokens(config.vocab_size, config.seq_len, batch_size, seed=seed)

    def new_state():
        return TrainState.create(apply_fn=model.apply, params=linen_init(config, seed),
                                 tx=optax.adamw(1e-3, weight_decay=0.01))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    return new_state, data, train_step


def run(args) -> int:
    import jax.numpy as jnp

    from .. import CheckpointManager

    new_state, data, train_step = build(args.seed, args.batch_size)
    with CheckpointManager(args.dir, save_interval_steps=args.interval, window=args.window,
                           max_to_keep=args.max_to_keep) as mngr:
        if args.resume:
            if mngr.latest_step() is None:
                _emit(ev="error", msg=f"no committed checkpoint in {args.dir}")
                return 1
            state = mngr.restore(target_state=new_state())
            _emit(ev="resumed", step=int(state.step))
        else:
            state = mngr.prepare(new_state())
        schedule = mngr.engine.schedule
        reported = 0
        for t in range(int(state.step), args.steps):
            phase = schedule.phase(t)
            batch = {"tokens": jnp.asarray(data.batch(t)["tokens"])}
            t0 = time.perf_counter()
            state, loss = train_step(state, batch)
            state = mngr.step(state)
            bits = _loss_bits(loss)  # syncs on the step
            _emit(ev="step", t=t, loss=bits, dt=time.perf_counter() - t0, phase=phase)
            history = mngr.store.history
            for rec in history[reported:]:
                _emit(ev="commit", step=rec.step, nbytes=rec.nbytes, persist_s=rec.persist_seconds)
            reported = len(history)
            mid_window = phase is not None and (phase < schedule.k - 1 or schedule.k == 1)
            if args.handshake and mid_window and reported >= 2:
                _emit(ev="wait", t=t, phase=phase, version=schedule.version(t, phase))
                if sys.stdin.readline().strip() != "go":
                    return 1
        mngr.wait_until_finished()
        for rec in mngr.store.history[reported:]:
            _emit(ev="commit", step=rec.step, nbytes=rec.nbytes, persist_s=rec.persist_seconds)
    _emit(ev="done")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlap_ckpt.tools.demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="run one training worker of the demo")
    tr.add_argument("--dir", required=True)
    tr.add_argument("--steps", type=int, default=120)
    tr.add_argument("--interval", type=int, default=20)
    tr.add_argument("--window", type=int, default=3)
    tr.add_argument("--batch-size", type=int, default=8)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--max-to-keep", type=int, default=None)
    tr.add_argument("--resume", action="store_true")
    tr.add_argument("--handshake", action="store_true")
    args = p.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
