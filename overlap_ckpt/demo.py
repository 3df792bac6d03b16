"""Training worker of ``overlap-ckpt demo``: ``python -m overlap_ckpt.demo train ...``.

One process runs one of three loops of the tiny Flax Linen LM (adamw, synthetic data whose
position is the step number), all with the same donating jitted step:

* ``--mode orbax``: uninterrupted reference run (no overlap capture) that also saves with an
  async Orbax ``CheckpointManager`` every ``interval`` steps (the stall baseline);
* ``--mode overlap``: overlapped checkpoints into ``--dir`` with :class:`OverlapEngine`
  and :class:`CheckpointStore`; with ``--resume`` it starts from the latest committed step.

The worker reports on stdout, one JSON object per line (flushed): ``step`` events (loss as
float32 bit pattern, step time), ``commit`` events, ``wait`` (handshake: with
``--handshake`` the worker stops in the middle of a window, once two checkpoints are
committed, and reads a line from stdin before going on, so the parent can SIGKILL it at a
known point), and a final ``done``.
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
    """Model config, optimizer, data, init params and the (not yet jitted) loss."""
    import optax

    from .models import LMConfig, SyntheticTokens, TransformerLM, linen_init, linen_loss_fn

    config = LMConfig.preset("tiny")
    model = TransformerLM(config)
    tx = optax.adamw(1e-3, weight_decay=0.01)
    data = SyntheticTokens(config.vocab_size, config.seq_len, batch_size, seed=seed)
    params = linen_init(config, seed)

    def loss_fn(params, batch):
        return linen_loss_fn(model.apply, params, batch)

    return config, tx, data, params, loss_fn


def run(args) -> int:
    import jax
    import jax.numpy as jnp

    from .engine import OverlapEngine
    from .capture import capture_update
    from .storage import CheckpointStore

    _, tx, data, params, loss_fn = build(args.seed, args.batch_size)
    opt_state = tx.init(params)
    start = 0
    store = engine = manager = None
    if args.mode == "overlap":
        store = CheckpointStore(args.dir, max_to_keep=args.max_to_keep)
        engine = OverlapEngine(tx, store, interval=args.interval, window=args.window)
        if args.resume:
            latest = store.latest_step()
            if latest is None:
                _emit(ev="error", msg=f"no committed checkpoint in {args.dir}")
                return 1
            abstract = {"params": params, "opt_state": opt_state, "extras": {"step": jnp.int32(0)}}
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                    abstract)
            del params, opt_state
            tree, meta = store.restore(latest, target=abstract)
            params, opt_state = tree["params"], tree["opt_state"]
            start = int(tree["extras"]["step"])
            if start != latest or int(meta.get("data_position", -1)) != start:
                _emit(ev="error", msg=f"checkpoint {latest} holds step {start}, metadata {meta}")
                return 1
            _emit(ev="resumed", step=start)
    elif args.mode == "orbax":
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager(
            args.dir, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True,
                                                           max_to_keep=args.max_to_keep))

    plan = engine.plan_for(params, opt_state, {"step": jnp.int32(start)}) if engine else None
    if plan is None:
        from .plan import make_plan

        plan = make_plan(tx, params, opt_state, {"step": jnp.int32(0)}, 1)

    @functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
    def train_step(plan, phase, params, opt_state, batch, t):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        params, opt_state, outbox = capture_update(plan, phase, params, opt_state, grads,
                                                   {"step": t}, step=t)
        return params, opt_state, outbox, loss

    k = engine.schedule.k if engine else 1
    reported = 0
    waiting_allowed = args.handshake
    for t in range(start, args.steps):
        phase = engine.phase(t) if engine else None
        batch = {"tokens": jnp.asarray(data.batch(t)["tokens"])}
        t0 = time.perf_counter()
        params, opt_state, outbox, loss = train_step(plan, phase, params, opt_state, batch, jnp.int32(t))
        if phase is not None:
            version = t - phase + k - 1
            engine.submit(t, phase, outbox, {"data_position": version})
        if manager is not None and (t + 1) % args.interval == 0:
            # state after step t is the input of step t + 1: checkpoint step t + 1
            manager.save(t + 1, args=ocp.args.StandardSave(
                {"params": params, "opt_state": opt_state, "step": jnp.int32(t + 1)}))
        bits = _loss_bits(loss)  # syncs on the step
        dt = time.perf_counter() - t0
        _emit(ev="step", t=t, loss=bits, dt=dt, phase=phase,
              save=manager is not None and (t + 1) % args.interval == 0)
        if store is not None:
            for rec in store.history[reported:]:
                _emit(ev="commit", step=rec.step, nbytes=rec.nbytes, persist_s=rec.persist_seconds)
            reported = len(store.history)
            mid_window = phase is not None and (phase < k - 1 if k > 1 else True)
            if waiting_allowed and mid_window and reported >= 2:
                _emit(ev="wait", t=t, phase=phase, version=t - phase + k - 1)
                if sys.stdin.readline().strip() != "go":
                    return 1
    if engine is not None:
        engine.wait_until_finished()
        engine.close()
    if store is not None:
        store.wait_until_finished()
        for rec in store.history[reported:]:
            _emit(ev="commit", step=rec.step, nbytes=rec.nbytes, persist_s=rec.persist_seconds)
        store.close()
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    _emit(ev="done")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlap_ckpt.demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="run one training worker of the demo")
    tr.add_argument("--mode", choices=("overlap", "orbax"), required=True)
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
