"""Per-step cost of the in-graph capture, and host replay throughput.

Trains an MLP-shaped state (``--params`` parameters, Adam) with a donating jitted step,
three ways in one run: no checkpointing, and windows of K=1 and K=``--window`` every
``--interval`` steps (in-memory sink, so only capture + replay are measured). Reports the
median step time, the extra time per window step relative to no checkpointing, and the
host replay throughput (GB of state advanced per second of host time).

    python -m benchmarks.bench_engine --params 100e6 --window 3
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from overlap_ckpt import MemorySink, OverlapEngine, capture_update
from overlap_ckpt.core.capture import WindowTicket


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


def run(params, tx, *, window: int | None, interval: int, steps: int, batch: int, width: int):
    opt_state = tx.init(params)
    params = jax.tree.map(jnp.copy, params)
    engine = OverlapEngine(tx, MemorySink(), interval=interval, window=window or 1)
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
        if t == warmup - 1:
            engine.wait_until_finished()
            engine.replay_seconds, engine.replayed_bytes, engine.windows_completed = 0.0, 0, 0
        if t >= warmup:
            times.append(time.perf_counter() - start)
            in_window.append(ticket is not None)
    engine.wait_until_finished()
    engine.close()
    return engine, plan, times, in_window


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--window", type=int, default=3)
    ap.add_argument("--interval", type=int, default=6)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    params = make_state(args.params, args.width)
    n = sum(p.size for p in jax.tree.leaves(params))
    tx = optax.adam(1e-4)
    common = dict(interval=args.interval, steps=args.steps, batch=args.batch, width=args.width)
    _, _, base, _ = run(params, tx, window=None, **common)
    base_median = statistics.median(base)
    report = {"params": int(n), "state_bytes": int(n * 12), "baseline_step_s": base_median, "runs": {}}
    for k in sorted({1, args.window}):
        engine, plan, times, in_window = run(params, tx, window=k, **common)
        window_steps = [t for t, w in zip(times, in_window) if w]
        added = statistics.mean(window_steps) - base_median
        report["runs"][f"K={plan.k}"] = {
            "window_step_s": statistics.mean(window_steps),
            "added_per_window_step_s": added,
            "added_per_window_step_ratio": added / base_median,
            "amortized_added_per_step_ratio": added * plan.k / args.interval / base_median,
            "windows_measured": engine.windows_completed,
            "replay_gb_per_s": (engine.replayed_bytes / 1e9 / engine.replay_seconds) if engine.replayed_bytes else None,
            "host_seconds_per_window": engine.replay_seconds / max(engine.windows_completed, 1),
        }
    print(f"state: {n / 1e6:.1f}M params, {n * 12 / 2**30:.2f} GiB (params + Adam), "
          f"baseline step {base_median * 1e3:.1f} ms ({jax.default_backend()})")
    print("| run | window step (ms) | added per window step | amortized per step | replay GB/s |")
    print("|---|---|---|---|---|")
    for name, r in report["runs"].items():
        replay = f"{r['replay_gb_per_s']:.2f}" if r["replay_gb_per_s"] else "n/a (K=1)"
        print(f"| {name} | {r['window_step_s'] * 1e3:.1f} | {r['added_per_window_step_ratio'] * 100:+.1f}% "
              f"| {r['amortized_added_per_step_ratio'] * 100:+.2f}% | {replay} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
