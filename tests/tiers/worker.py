"""Training worker of the local-tier tests (also importable: the tests resume in-process).

The reliability suite's MLP (tests/faults/worker.py: same model, batches and step) trained
through ``CheckpointManager(local=LocalTier(...))``: a local checkpoint every ``EVERY`` steps,
a durable one every ``INTERVAL`` steps, windows of K=``WINDOW``.

Run as ``python tests/tiers/worker.py --dir D --local L --steps N [--resume]``. Faults:
``FAULT=kill:<stage>:<step>`` (SIGKILL in a storage stage, tests/faults/worker.py),
``KILL_CAPTURE=<version>`` (SIGKILL right after phase 0 of that window was handed to the
engine; earlier checkpoints are waited for first), ``PREEMPT=<deadline_s>`` with ``STEP_SLEEP`` (SIGTERM handler installed).
stdout: one JSON object per line (``step`` with the loss bits, ``resumed``, ``done``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

if __name__ == "__main__":  # as pytest imports it: the tests folder on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from faults.worker import _train_step, batch, emit, events, install_fault, loss_bits, make_state  # noqa: E402

EVERY, INTERVAL, WINDOW, KEEP = 2, 6, 2, 2

__all__ = ["EVERY", "INTERVAL", "WINDOW", "KEEP", "manager", "run", "launch", "events"]


def manager(durable, local, *, every: int = EVERY):
    import overlap_ckpt as oc
    from overlap_ckpt.storage import CheckpointStore

    # "block": every window's checkpoint is written (the engine thread waits, never the
    # training thread), so a run without faults leaves a known set of steps.
    store = CheckpointStore(durable, max_to_keep=KEEP, on_backpressure="block")
    return oc.CheckpointManager(durable, save_interval_steps=INTERVAL, window=WINDOW, store=store,
                                local=oc.LocalTier(local, every=every, max_to_keep=KEEP))


def run(durable, local, steps: int, *, seed: int = 0, resume: bool = False, kill_capture: int | None = None,
        on_step=None, preempt_deadline: float | None = None, step_sleep: float = 0.0) -> dict:
    """Train to ``steps`` (from the newest complete checkpoint with ``resume``); returns
    ``{"losses": {t: bits}, "start": first step}``."""
    train_step = _train_step()
    losses = {}
    with manager(durable, local) as mngr:
        if preempt_deadline is not None:
            from overlap_ckpt import preemption
            preemption.install(mngr, deadline_s=preempt_deadline)
        state = mngr.restore(target_state=make_state(seed)) if resume else mngr.prepare(make_state(seed))
        start = int(state.step)
        emit(ev="resumed", step=start)
        for t in range(start, steps):
            phase = mngr.next_window_phase
            capture_kill = kill_capture is not None and phase == 0 and t + WINDOW - 1 == kill_capture
            if capture_kill:
                mngr.wait_until_finished()  # what is committed before the kill is then known
            x, y = batch(seed, t)
            state, loss = train_step(state, x, y)
            state = mngr.step(state)
            losses[t] = loss_bits(loss)
            emit(ev="step", t=t, loss=losses[t])
            if capture_kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if on_step is not None:
                on_step(t, state, mngr)
            if step_sleep:
                time.sleep(step_sleep)
    return {"losses": losses, "start": start}


def launch(durable, local, *, steps: int, env: dict | None = None):
    """Start this worker as a subprocess (stdout/stderr piped); returns the Popen."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    full = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("FAULT", "KILL_CAPTURE", "PREEMPT", "STEP_SLEEP"):
        full.pop(k, None)
    full.update(env or {})
    cmd = [sys.executable, os.path.abspath(__file__), "--dir", str(durable), "--local", str(local),
           "--steps", str(steps)]
    return subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--local", required=True)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    install_fault(os.environ.get("FAULT"))
    kill = os.environ.get("KILL_CAPTURE")
    preempt = os.environ.get("PREEMPT")
    run(args.dir, args.local, args.steps, resume=args.resume, kill_capture=int(kill) if kill else None,
        preempt_deadline=float(preempt) if preempt else None, step_sleep=float(os.environ.get("STEP_SLEEP", 0)))
    emit(ev="done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
