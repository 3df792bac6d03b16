"""Per-step cost of the in-graph capture, and host replay throughput.

Trains an MLP-shaped state (``--params`` parameters, Adam) with a donating jitted step,
three ways in one run: no checkpointing, and windows of K=1 and K=``--window`` every
``--interval`` steps (a sink that drops each copy at once, so only capture + replay are
measured, in host buffers reused across windows as beside a storage sink that keeps up). Reports the
median step time, the extra time per window step relative to no checkpointing, and the
host replay throughput (GB of state advanced per second of host time).

Replay against memcpy (issue 20's target: >= 50% of a warm memcpy for Adam-style chains):
the bytes of params + Adam moments the replay calls advanced, per second spent in those
calls (inputs viewed, the optimizer run on the CPU backend in place or, for whole-leaf
plans, its outputs written back), next to ``np.copyto`` of as many bytes into an already
touched destination, in the same process right after the run. The receive time (for
whole-leaf plans, copying the captured slice in) is reported separately, as the whole host
time per window.

    python -m benchmarks.bench_engine --params 100e6 --window 3
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import numpy as np
import jax
import jax.numpy as jnp
import optax

from overlap_ckpt import OverlapEngine, capture_update
from overlap_ckpt.core.ticket import WindowTicket


class DoneAtOnceSink:
    """A sink that is done with each host copy as soon as it receives it: the steady state
    of a storage sink whose writes keep up, where the engine copies every window into the
    host buffers of the one before. (``MemorySink`` keeps every copy, so each window
    copied into freshly allocated memory and paid a page fault per page: measured here on
    the 20M state, K=3, 0.23 s of the 0.31 s host time per window.)"""

    def put(self, step: int, tree, metadata=None) -> None:
        del step, tree, metadata  # nothing read here: only capture and replay are measured

    def busy_steps(self) -> tuple[int, ...]:
        return ()


def make_state(n_params: float, width: int):
    layers = max(1, int(n_params // (width * width)))
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    params = {f"layer{i:03d}": jax.random.normal(k, (width, width), jnp.float32) / width ** 0.5
              for i, k in enumerate(keys)}
    return params


def loss_fn(params, x):
    for w in params.values():
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def run(params, tx, *, window: int | None, interval: int, steps: int, batch: int, width: int,
        replay_alone: bool = False, whole_leaves: bool = False):
    opt_state = tx.init(params)
    params = jax.tree.map(jnp.copy, params)
    engine = OverlapEngine(tx, DoneAtOnceSink(), interval=interval, window=window or 1,
                           chunk_leaves=False if whole_leaves else None)
    plan = engine.plan_for(params, opt_state, {"step": jnp.int32(0)})

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(ticket, params, opt_state, x, t):
        grads = jax.grad(loss_fn)(params, x)
        return capture_update(tx, ticket, params, opt_state, grads, {"step": t}, step=t)

    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    # Compile every phase variant before timing.
    for phase in [None, *range(plan.k)] if window else [None]:
        ticket = None if phase is None else WindowTicket(plan, phase)
        step(ticket, jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, opt_state), x, jnp.int32(0))
    times, in_window = [], []
    warmup = interval + 1 if window else 0  # one whole window compiles the host replay programs
    for t in range(warmup + steps):
        ticket = engine.ticket(t) if window else None
        start = time.perf_counter()
        params, opt_state, outbox = step(ticket, params, opt_state, x, jnp.int32(t))
        jax.block_until_ready(params)
        if outbox is not None:
            engine.submit(t, outbox)
            if replay_alone:  # the replay does not share the CPU with the next step
                engine.flush()
        if t == warmup - 1:
            engine.wait_until_finished()
            engine.replay_seconds, engine.apply_seconds, engine.replayed_bytes, engine.windows_completed = 0.0, 0.0, 0, 0
        if t >= warmup:
            times.append(time.perf_counter() - start)
            in_window.append(ticket is not None)
    engine.wait_until_finished()
    engine.close()
    return engine, plan, times, in_window


def warm_memcpy_bytes_per_s(nbytes: int, repeats: int = 11) -> float:
    """``np.copyto`` bandwidth for ``nbytes`` into a destination written once before (no
    page faults), the fastest of ``repeats`` (on a loaded host the least disturbed one):
    the reference the replay is compared with, so the ratio errs low."""
    src = np.ones(max(nbytes // 4, 1), np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return src.nbytes / min(times)


def direct_update_bytes_per_s(params, tx, repeats: int = 5) -> float:
    """The same optax update jitted on the whole state as JAX arrays (params and moments
    donated, so XLA updates them in place), state bytes per second, the fastest of
    ``repeats``: what XLA:CPU itself reaches on this host for this chain, with no slicing,
    gathering or copying back. It tells how much of the gap to a memcpy is the replay's
    and how much is the optimizer's arithmetic on this CPU."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jax.tree.map(jnp.copy, params)
    opt_state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    nbytes = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    params, opt_state = jax.block_until_ready(update(params, opt_state, grads))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        params, opt_state = jax.block_until_ready(update(params, opt_state, grads))
        times.append(time.perf_counter() - start)
    return nbytes / min(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--interval", type=int, default=6)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--replay-alone", action="store_true",
                    help="wait for each phase's replay before the next step (replay throughput on an "
                         "idle host, as beside an accelerator; step times then include the replay)")
    ap.add_argument("--whole-leaves", action="store_true",
                    help="slice by whole leaves (the plan of optimizers whose code depends on leaf "
                         "shapes) instead of row chunks")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    params = make_state(args.params, args.width)
    n = sum(p.size for p in jax.tree.leaves(params))
    tx = optax.adam(1e-4)
    common = dict(interval=args.interval, steps=args.steps, batch=args.batch, width=args.width)
    _, _, base, _ = run(params, tx, window=None, **common)
    base_median = statistics.median(base)
    direct = direct_update_bytes_per_s(params, tx)
    report = {"params": int(n), "state_bytes": int(n * 12), "baseline_step_s": base_median,
              "replay_alone": args.replay_alone,
              "whole_leaves": args.whole_leaves, "direct_update_gb_per_s": direct / 1e9, "runs": {}}
    for k in sorted({1, args.window}):
        engine, plan, times, in_window = run(params, tx, window=k, replay_alone=args.replay_alone,
                                             whole_leaves=args.whole_leaves, **common)
        window_steps = [t for t, w in zip(times, in_window) if w]
        added = statistics.mean(window_steps) - base_median
        replay = engine.replayed_bytes / engine.apply_seconds if engine.replayed_bytes else None
        per_window = engine.replayed_bytes // max(engine.windows_completed, 1)
        memcpy = warm_memcpy_bytes_per_s(per_window) if per_window else None
        report["runs"][f"K={plan.k}"] = {
            "window_step_s": statistics.mean(window_steps),
            "added_per_window_step_s": added,
            "added_per_window_step_ratio": added / base_median,
            "amortized_added_per_step_ratio": added * plan.k / args.interval / base_median,
            "windows_measured": engine.windows_completed,
            "replay_gb_per_s": replay / 1e9 if replay else None,
            "memcpy_gb_per_s": memcpy / 1e9 if memcpy else None,
            "replay_vs_memcpy": replay / memcpy if replay else None,
            "direct_vs_memcpy": direct / memcpy if memcpy else None,
            "replayed_bytes_per_window": per_window,
            "host_seconds_per_window": engine.replay_seconds / max(engine.windows_completed, 1),
            "replay_calls_seconds_per_window": engine.apply_seconds / max(engine.windows_completed, 1),
        }
    print(f"state: {n / 1e6:.1f}M params, {n * 12 / 2**30:.2f} GiB (params + Adam), "
          f"baseline step {base_median * 1e3:.1f} ms ({jax.default_backend()})")
    print("| run | window step (ms) | added per window step | amortized per step | replay GB/s | "
          "warm memcpy GB/s | replay / memcpy | optax direct / memcpy | host s per window |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in report["runs"].items():
        if r["replay_gb_per_s"]:
            replay = (f"{r['replay_gb_per_s']:.2f} | {r['memcpy_gb_per_s']:.2f} | "
                      f"{r['replay_vs_memcpy'] * 100:.0f}% | {r['direct_vs_memcpy'] * 100:.0f}%")
        else:
            replay = "n/a (K=1) | | | "
        print(f"| {name} | {r['window_step_s'] * 1e3:.1f} | {r['added_per_window_step_ratio'] * 100:+.1f}% "
              f"| {r['amortized_added_per_step_ratio'] * 100:+.2f}% | {replay} | {r['host_seconds_per_window']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
