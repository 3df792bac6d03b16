"""Goodput under failures, measured: train a fixed number of steps with a SIGKILL every X s.

Run from the repository root::

    python -m benchmarks.bench_goodput --model 20m --steps 80 --kill-every 30 \
        --out benchmarks/results/goodput_cpu_20m
    python -m benchmarks.bench_goodput --model tiny --steps 12 --kill-every 12 --out /tmp/g  # smoke

For each configuration a fresh training process (the Flax transformer LM, adamw, the same
synthetic batches: batch ``t`` is a function of ``t`` only) starts, resumes from its newest
checkpoint, and is killed with SIGKILL ``--kill-every`` seconds after it started; the driver
restarts it until ``--steps`` steps are trained (JAX's persistent compilation cache on, as
a production job would restart; two lives in a row without a trained step stop the run: the
kill interval is shorter than a restart). Configurations:

* ``orbax_async``: stock ``ocp.CheckpointManager`` (async), a save every ``--interval`` steps;
* ``durable``: ``overlap_ckpt.CheckpointManager(save_interval_steps=--interval)``;
* ``local``: the same with ``local=LocalTier(/dev/shm/..., every=--every)``.

Reported per configuration: useful steps per wall-clock second (``--steps`` / total time),
steps trained in all (recomputed = trained - ``--steps``), kills, and the time from a
restart to its first trained step (process start, imports, restore, compile).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.reporting import publish

CONFIGS = ("orbax_async", "durable", "local")


def _emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def train(spec: dict) -> None:
    """One life of a training process: resume, train until ``steps`` or until killed."""
    import functools

    import jax
    import optax

    import overlap_ckpt as oc
    from overlap_ckpt.tools.models import LMConfig, SyntheticTokens, TransformerLM, linen_init, linen_loss_fn

    config = LMConfig.preset(spec["model"])
    model = TransformerLM(config)
    data = SyntheticTokens(config.vocab_size, config.seq_len, spec["batch_size"], seed=0)
    state = oc.TrainState.create(apply_fn=model.apply, params=linen_init(config, 0),
                                 tx=optax.adamw(1e-3, weight_decay=0.01))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads), loss

    cfg, n = spec["config"], spec["interval"]
    mngr = omngr = None
    if cfg == "orbax_async":
        import orbax.checkpoint as ocp
        omngr = ocp.CheckpointManager(spec["dir"], options=ocp.CheckpointManagerOptions(
            save_interval_steps=n, max_to_keep=2))
        latest = omngr.latest_step()
        if latest is not None:
            tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state}
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
            back = omngr.restore(latest, args=ocp.args.StandardRestore(abstract))
            state = state.replace(step=back["step"], params=back["params"], opt_state=back["opt_state"])
    else:
        local = oc.LocalTier(spec["local"], every=spec["every"]) if cfg == "local" else None
        mngr = oc.CheckpointManager(spec["dir"], save_interval_steps=n, max_to_keep=2, window=1, local=local)
        state = mngr.restore(target_state=state) if mngr.latest_step() is not None else mngr.prepare(state)
    start = int(state.step)
    _emit(ev="resumed", step=start, time=time.time())
    for t in range(start, spec["steps"]):
        state, loss = train_step(state, {"tokens": data.batch(t)["tokens"]})
        if mngr is not None:
            state = mngr.step(state)
        elif (t + 1) % n == 0:
            omngr.save(t + 1, args=ocp.args.StandardSave(
                {"step": state.step, "params": state.params, "opt_state": state.opt_state}))
        jax.block_until_ready(loss)
        _emit(ev="step", t=t, time=time.time())
    (mngr or omngr).wait_until_finished()
    _emit(ev="done", time=time.time())


def run_config(cfg: str, args, root: str) -> dict:
    """Train ``args.steps`` steps of ``cfg`` under a SIGKILL every ``args.kill_every`` s."""
    spec = {"config": cfg, "model": args.model, "batch_size": args.batch_size, "steps": args.steps,
            "interval": args.interval, "every": args.every, "dir": os.path.join(root, cfg),
            "local": os.path.join(args.local_root, f"{os.path.basename(root)}_{cfg}")}
    # A restarted job reuses its compiled programs (JAX's persistent cache), as production jobs do.
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               JAX_COMPILATION_CACHE_DIR=os.path.join(root, f"jax_cache_{cfg}"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    lives, trained, t0 = [], 0, time.monotonic()
    try:
        while True:
            started = time.time()
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_goodput", "--worker", json.dumps(spec)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            timer = threading.Timer(args.kill_every, lambda p=proc: p.send_signal(signal.SIGKILL))
            timer.start()
            events = [json.loads(line) for line in proc.stdout if line.startswith('{"ev"')]
            proc.wait()
            timer.cancel()
            steps = [e for e in events if e["ev"] == "step"]
            resumed = next((e["step"] for e in events if e["ev"] == "resumed"), None)
            lives.append({"resumed": resumed, "steps": len(steps), "killed": proc.returncode == -signal.SIGKILL,
                          "first_step_s": steps[0]["time"] - started if steps else None})
            trained += len(steps)
            if proc.returncode == 0:
                break
            stuck = len(lives) >= 3 and not any(life["steps"] for life in lives[-2:])
            if proc.returncode != -signal.SIGKILL or len(lives) > args.max_lives or stuck:
                raise RuntimeError(f"{cfg}: life {len(lives)} ended with {proc.returncode}: {lives[-1]}")
    finally:
        shutil.rmtree(spec["local"], ignore_errors=True)
    wall = time.monotonic() - t0
    firsts = [life["first_step_s"] for life in lives[1:] if life["first_step_s"] is not None]
    return {"config": cfg, "wall_s": wall, "useful_steps_per_s": args.steps / wall, "trained": trained,
            "recomputed": trained - args.steps, "kills": sum(life["killed"] for life in lives),
            "restart_to_first_step_s": statistics.median(firsts) if firsts else None, "lives": lives}


def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# Goodput under a SIGKILL every {a['kill_every']} s: {a['model']} on {report['device']}", "",
             f"`python -m benchmarks.bench_goodput {' '.join(report['argv'])}`: {a['steps']} steps, batch "
             f"{a['batch_size']}, durable checkpoint every {a['interval']} steps (Orbax async and overlap_ckpt), "
             f"local tier every {a['every']} steps (tmpfs). Machine: {report['machine']}.", "",
             "| configuration | useful steps/s | wall s | steps trained | recomputed | kills | restart to first step s (median) |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for r in report["runs"]:
        first = "n/a" if r["restart_to_first_step_s"] is None else f"{r['restart_to_first_step_s']:.1f}"
        lines.append(f"| {r['config']} | {r['useful_steps_per_s']:.3f} | {r['wall_s']:.0f} | {r['trained']} | "
                     f"{r['recomputed']} | {r['kills']} | {first} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="20m")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--kill-every", type=float, default=30.0)
    ap.add_argument("--interval", type=int, default=20)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--max-lives", type=int, default=30)
    ap.add_argument("--local-root", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    ap.add_argument("--out", default=None, help="writes <out>.json and <out>.md")
    args = ap.parse_args(argv)
    if args.worker:
        train(json.loads(args.worker))
        return None
    import platform

    root = tempfile.mkdtemp(prefix="bench_goodput_")
    try:
        runs = [run_config(cfg, args, root) for cfg in args.configs]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"args": vars(args), "argv": argv, "runs": runs, "device": "cpu",
              "machine": f"{platform.platform()}, {os.cpu_count()} CPUs"}
    publish(report, markdown(report), args.out)
    return report


if __name__ == "__main__":
    main()
