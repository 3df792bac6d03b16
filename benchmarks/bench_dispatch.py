"""How long the training thread takes to issue the step after a checkpoint, beside Orbax async.

    python -m benchmarks.bench_dispatch [--layers 200] [--rounds 2] [--gc-freeze] [--out PREFIX]

A model of many small leaves (``--layers`` Dense 128x128 layers, adamw: 3 arrays per
parameter), so that a step costs the CPU little and the training thread's own time shows:
the jitted call, the freeing of the state it donated, and the checkpointer's per-step call.
Each configuration (no checkpointing, Orbax async, overlap_ckpt K=1 and K=3) runs in a fresh
process, a checkpoint every ``--interval`` steps, one sync per step and a pause after it that
stands for the device's time (the background threads run then, as beside an accelerator).
Why: jaxlib releases the GIL around freeing each array, so a background thread running Python
while the training thread frees its donated state makes it wait up to CPython's switch
interval (5 ms) per array (``overlap_ckpt/gil.py``); on an H200 that was most of a
checkpoint's cost (``results/gpu_h200_100m_profile.md``). Reported: the median time to issue
the steps outside checkpoints, and the median and worst time to issue the first step after
each checkpoint, each as a multiple of the no-checkpoint run's median; then the mean over
every step, checkpoints' own steps included, and the worst step outside checkpoints. Why
those two: a medians-only table hides the waits that come once per checkpoint (Orbax's
``save`` waiting for the previous one, a window waiting for host memory, logged by
``overlap_ckpt.manager.host_budget``). Last, the full (generation 2) garbage collections in the
measured span, on any thread: each holds the GIL, so the training thread waits that long if it
needs the GIL meanwhile. ``--gc-freeze`` moves every object alive after the warm-up out of the
collector's reach (``gc.collect(); gc.freeze()``, in every configuration at the same step), as
``docs/choosing_k.md`` suggests: the compiled window variants' traces are then not scanned again.
The last column counts the objects the collector tracks at the end of the measured span, and
those a full collection would walk (not frozen).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import tempfile
import time

from benchmarks.harness import run_fresh
from benchmarks.lm_loop import orbax_async_manager
from benchmarks.reporting import publish

CONFIGS = ("none", "orbax_async", "overlap_k1", "overlap_k3")
WARMUP_INTERVALS = 2  # not measured (see run_config)
LABELS = {"none": "no checkpointing", "orbax_async": "Orbax async", "overlap_k1": "overlap K=1",
          "overlap_k3": "overlap K=3"}


class FullCollections:
    """The pauses of full (generation 2) garbage collections on any thread, inside the
    ``with`` block once ``counting`` is set."""

    def __init__(self):
        self.pauses_s: list[float] = []
        self._started: float | None = None  # one collection at a time: CPython's runs with the GIL held
        self.counting = False

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2 or not self.counting:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses_s.append(time.perf_counter() - self._started)
            self._started = None


def run_config(config: str, layers: int, interval: int, checkpoints: int, pause_s: float,
               gc_freeze: bool = False) -> dict:
    """Issue ``interval * (checkpoints + WARMUP_INTERVALS)`` steps; the first intervals are
    warm-up: with one, the step after the first measured checkpoint took 225 ms against 7-21 ms after later
    ones (K=3), a cost of the run's start (its first persist was still running)."""
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp

    import overlap_ckpt as oc

    params = {f"l{i}": {"w": jnp.full((128, 128), 0.01, jnp.float32), "b": jnp.zeros((128,), jnp.float32)}
              for i in range(layers)}

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, x):
        def loss_fn(p):
            h = x
            for i in range(layers):
                h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
            return jnp.mean(h ** 2)
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    x = jnp.ones((8, 128))
    state = oc.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-3))
    directory = tempfile.mkdtemp(prefix="bench_dispatch_")
    mngr = omngr = None
    if config.startswith("overlap"):
        mngr = oc.CheckpointManager(directory, save_interval_steps=interval, max_to_keep=2,
                                    window=int(config[-1]))
        state = mngr.prepare(state)
        mngr.compile_ahead(train_step, state, x)
    elif config == "orbax_async":
        omngr = orbax_async_manager(directory, interval)
    rows = []
    freeze_collect_s = None
    with FullCollections() as full_gcs:
        for t in range(interval * (checkpoints + WARMUP_INTERVALS)):
            if t == interval * WARMUP_INTERVALS:
                if gc_freeze:  # once, where the user would: timed apart
                    collect_start = time.perf_counter()
                    gc.collect()
                    gc.freeze()
                    freeze_collect_s = time.perf_counter() - collect_start
                full_gcs.counting = True
            phase = mngr.next_window_phase if mngr is not None else None
            start = time.perf_counter()
            state = train_step(state, x)  # frees the donated state
            saved = False
            if mngr is not None:
                state = mngr.step(state)
            elif omngr is not None and (t + 1) % interval == 0:
                saved = bool(omngr.save(t + 1, args=ocp.args.StandardSave(
                    {"step": state.step, "params": state.params, "opt_state": state.opt_state})))
            issued = time.perf_counter() - start
            jax.block_until_ready(state)
            time.sleep(pause_s)
            rows.append({"t": t, "checkpoint": phase is not None or saved, "issue_s": issued})
    gc.collect()
    scanned = len(gc.get_objects())  # what a full collection walks: the frozen ones are not listed
    if mngr is not None:
        mngr.close()
    if omngr is not None:
        omngr.close()
    rows = rows[WARMUP_INTERVALS * interval:]
    after = [rows[i + 1]["issue_s"] for i in range(len(rows) - 1)
             if rows[i]["checkpoint"] and not rows[i + 1]["checkpoint"]]
    others = [r["issue_s"] for i, r in enumerate(rows)
              if not r["checkpoint"] and not (i and rows[i - 1]["checkpoint"])]
    return {"config": config, "leaves": len(jax.tree.leaves(state)), "after_s": after, "others_s": others,
            "all_s": [r["issue_s"] for r in rows], "full_gc_s": full_gcs.pauses_s,
            "freeze_collect_s": freeze_collect_s, "objects": scanned + gc.get_freeze_count(),
            "objects_scanned": scanned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--interval", type=int, default=8)
    ap.add_argument("--checkpoints", type=int, default=10, help="measured checkpoints per run")
    ap.add_argument("--pause-ms", type=float, default=20.0, help="after each step: the device's time")
    ap.add_argument("--rounds", type=int, default=2, help="each configuration this many times, interleaved")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after the warm-up, in every config")
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(run_config(args.worker, args.layers, args.interval, args.checkpoints, args.pause_ms / 1e3,
                                    args.gc_freeze)))
        return
    runs = []
    for _ in range(args.rounds):
        for config in CONFIGS:
            runs.append(run_fresh("benchmarks.bench_dispatch",
                                  ["--worker", config, "--layers", str(args.layers), "--interval", str(args.interval),
                                   "--checkpoints", str(args.checkpoints), "--pause-ms", str(args.pause_ms)]
                                  + ["--gc-freeze"] * args.gc_freeze))
            print(f"{config}: done", file=sys.stderr)
    lines = [f"# Issuing the step after a checkpoint: {runs[0]['leaves']} state arrays", "",
             f"{args.interval} steps per checkpoint, {args.checkpoints} measured checkpoints per run, "
             f"{args.rounds} runs per configuration (interleaved), {args.pause_ms:g} ms pause after each step"
             + (", gc.freeze() after the warm-up (the gc.collect() before it took "
                f"{min(r['freeze_collect_s'] for r in runs) * 1e3:.0f}-"
                f"{max(r['freeze_collect_s'] for r in runs) * 1e3:.0f} ms, once per run; not counted below)."
                if args.gc_freeze else "."), "",
             "| config | other steps: median ms (x no checkpointing) | the step after a checkpoint: median ms "
             "(x no checkpointing) | its worst ms | every step, checkpoints' included: mean ms (x no checkpointing) "
             "| worst other step ms | full GCs per run | their ms per run | the longest ms "
             "| objects at the end (thousands): all / not frozen |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    plain = statistics.median(x for r in runs if r["config"] == "none" for x in r["others_s"])
    for config in CONFIGS:
        mine = [r for r in runs if r["config"] == config]
        others = statistics.median(x for r in mine for x in r["others_s"])
        after = [x for r in mine for x in r["after_s"]]
        cells = [LABELS[config], f"{others * 1e3:.2f} ({others / plain:.2f}x)"]
        if after:
            cells += [f"{statistics.median(after) * 1e3:.2f} ({statistics.median(after) / plain:.2f}x)",
                      f"{max(after) * 1e3:.1f}"]
        else:
            cells += ["-", "-"]
        mean_all = statistics.mean(x for r in mine for x in r["all_s"])
        cells += [f"{mean_all * 1e3:.2f} ({mean_all / plain:.2f}x)",
                  f"{max(x for r in mine for x in r['others_s']) * 1e3:.1f}"]
        pauses = [x for r in mine for x in r["full_gc_s"]]
        cells += [f"{len(pauses) / len(mine):.1f}", f"{sum(pauses) / len(mine) * 1e3:.0f}",
                  f"{max(pauses, default=0) * 1e3:.1f}",
                  f"{statistics.mean(r['objects'] for r in mine) / 1e3:.0f} / "
                  f"{statistics.mean(r['objects_scanned'] for r in mine) / 1e3:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    publish({"args": vars(args), "runs": runs}, "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
