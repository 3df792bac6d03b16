"""Training worker of the reliability suite (also importable: the tests resume in-process).

A tiny two-layer MLP trained with adam through :class:`overlap_ckpt.CheckpointManager`
(save interval 4, window K=2, max_to_keep 2). Batches are a pure function of (seed, step),
so two runs with the same seed compute bitwise-identical losses and states.

Run as ``python tests/faults/worker.py --dir D --steps N [--ref-dir R] [--resume]``. Faults
come from the environment:

* ``FAULT=kill:<stage>:<step>``  SIGKILL inside the storage stage of that step (fault hook);
* ``FAULT=eio:<stage>:<step>`` / ``enospc:<stage>:<step>``  the hook raises that OSError;
* ``FAULT=sleep:<stage>:<step>:<seconds>``  a slow disk;
* ``FAULT=killdelete:<step>``  SIGKILL in the middle of the retention delete of ``step``
  (after its rename to ``<step>.orbax-checkpoint-deleting``, before the rmtree);
* ``FAULT=killsubmit:<phase>:<version>``  SIGKILL right after the training thread handed
  phase ``phase`` of the window of ``version`` to the engine (capture/replay in flight).
  The worker first waits for earlier checkpoints, so what was committed is known.
* ``PREEMPT=<deadline_s>``  install :mod:`overlap_ckpt.manager.preemption`; ``STEP_SLEEP`` slows
  steps so a parent can send SIGTERM mid-run.

stdout: one JSON object per line: ``step`` (loss as float32 bits), ``commit``, ``error``, ``done``.
"""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import signal
import sys
import time

import numpy as np

INTERVAL, WINDOW, KEEP = 4, 2, 2
SHAPES = {"dense1": {"kernel": (8, 16), "bias": (16,)}, "dense2": {"kernel": (16, 4), "bias": (4,)}}


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def make_state(seed: int = 0):
    import jax.numpy as jnp
    import optax

    from overlap_ckpt.doors.linen import TrainState

    rng = np.random.default_rng(seed)
    params = {layer: {k: jnp.asarray(rng.standard_normal(s, dtype=np.float32) * 0.3)
                      for k, s in leaves.items()} for layer, leaves in SHAPES.items()}
    return TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))


def batch(seed: int, t: int):
    rng = np.random.default_rng([seed, t])
    return rng.standard_normal((4, 8), dtype=np.float32), rng.standard_normal((4, 4), dtype=np.float32)


def _loss(params, x, y):
    import jax.numpy as jnp

    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    out = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    return jnp.mean((out - y) ** 2)


@functools.lru_cache(maxsize=None)
def _train_step():
    import jax

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, x, y):
        loss, grads = jax.value_and_grad(_loss)(state.params, x, y)
        return state.apply_gradients(grads=grads), loss

    return train_step


def loss_bits(loss) -> int:
    return int(np.asarray(loss, dtype=np.float32).reshape(()).view(np.uint32))


def snapshot(state) -> dict[str, np.ndarray]:
    """A synchronous host copy of the checkpointed fields, keyed by tree path."""
    import jax

    tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def restored_snapshot(tree) -> dict[str, np.ndarray]:
    """The same keys for a tree restored by ``CheckpointStore.restore`` (numpy, no target)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {}
    for p, v in flat:
        key = jax.tree_util.keystr(p)
        out[key] = np.asarray(v)
    return out


def _parse_fault(text: str | None):
    if not text:
        return None
    kind, *rest = text.split(":")
    return kind, rest


def install_fault(text: str | None) -> None:
    """Install the storage fault named by ``text`` (see the module docstring)."""
    fault = _parse_fault(text)
    if fault is None:
        return
    kind, rest = fault
    from overlap_ckpt.storage import commit, set_fault_hook

    if kind == "killdelete":
        doomed_step = int(rest[0])
        original = commit.delete_step

        def delete_step(location, step):
            if step == doomed_step:
                from overlap_ckpt.storage import layout
                location.rename(layout.step_dir(step), f"{step}{layout.DELETING_SUFFIX}")
                os.kill(os.getpid(), signal.SIGKILL)
            original(location, step)

        commit.delete_step = delete_step
        return
    if kind == "killsubmit":
        return
    stage, every = rest[0], rest[1].startswith("+")  # "+8": every step >= 8
    step = int(rest[1].lstrip("+"))

    def hook(st, info):
        s = info.get("step")
        if st != stage or not (s == step or (every and s is not None and s >= step)):
            return
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "eio":
            raise OSError(errno.EIO, "Input/output error (injected)")
        elif kind == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        elif kind == "sleep":
            emit(ev="slow_begin", step=s)
            time.sleep(float(rest[2]))
            emit(ev="slow_end", step=s)

    set_fault_hook(hook)


def run(directory, steps: int, *, seed: int = 0, resume: bool = False, ref_dir=None,
        fault: str | None = None, window: int = WINDOW, on_step=None, step_sleep: float = 0.0,
        preempt_deadline: float | None = None, backpressure: str = "block") -> dict:
    """Train ``steps`` steps (from the latest checkpoint with ``resume``); returns
    ``{"losses": {t: bits}, "start": first step, "errors": [...], "steps": all_steps()}``."""
    from overlap_ckpt.manager import CheckpointManager

    train_step = _train_step()
    kill_submit = None
    parsed = _parse_fault(fault)
    if parsed and parsed[0] == "killsubmit":
        kill_submit = (int(parsed[1][0]), int(parsed[1][1]))
    losses, errors, reported = {}, [], 0
    from overlap_ckpt.errors import CheckpointError
    from overlap_ckpt.storage import CheckpointStore

    def record(error: BaseException) -> None:
        errors.append({"type": type(error).__name__, "errno": getattr(error, "errno", None),
                       "step": getattr(error, "step", None), "msg": str(error)})
        emit(ev="error", **errors[-1])

    # "block": every window's checkpoint is persisted (the engine thread waits, never the
    # training thread), so which steps exist at a kill point is deterministic.
    store = CheckpointStore(directory, max_to_keep=KEEP, on_backpressure=backpressure)
    mngr = CheckpointManager(directory, save_interval_steps=INTERVAL, window=window, store=store)
    try:
        if preempt_deadline is not None:
            from overlap_ckpt import preemption
            preemption.install(mngr, deadline_s=preempt_deadline)
        state = mngr.restore(target_state=make_state(seed)) if resume else mngr.prepare(make_state(seed))
        start = int(state.step)
        if resume:
            emit(ev="resumed", step=start)
        for t in range(start, steps):
            phase = mngr.next_window_phase  # the window phase this step captures
            if kill_submit and phase == 0 and t - phase + mngr.engine.schedule.k - 1 == kill_submit[1]:
                mngr.wait_until_finished()  # what is committed before the kill is then known
                emit(ev="settled", steps=mngr.all_steps())
            x, y = batch(seed, t)
            state, loss = train_step(state, x, y)
            try:
                state = mngr.step(state)
            except CheckpointError as e:  # a failed background checkpoint: note it, keep training
                for failure in e.failures:
                    record(failure.error)
                state = mngr.step(state)
            losses[t] = loss_bits(loss)
            emit(ev="step", t=t, loss=losses[t], phase=phase)
            if ref_dir is not None and (t + 1) % INTERVAL == 0:
                np.savez(os.path.join(ref_dir, f"{t + 1}.npz"), **snapshot(state))
            if kill_submit and phase == kill_submit[0] and \
                    t - phase + mngr.engine.schedule.k - 1 == kill_submit[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            history = mngr.store.history
            for rec in history[reported:]:
                emit(ev="commit", step=rec.step)
            reported = len(history)
            if on_step is not None:
                on_step(t, state, mngr)
            if step_sleep:
                time.sleep(step_sleep)
        if ref_dir is not None:
            np.savez(os.path.join(ref_dir, "final.npz"), **snapshot(state))
    finally:
        try:
            mngr.close()
        except CheckpointError as e:  # reported, as a training loop would log it
            for error in [f.error for f in e.failures] or [e]:
                record(error)
    for rec in mngr.store.history[reported:]:
        emit(ev="commit", step=rec.step)
    result = {"losses": losses, "start": start, "errors": errors,
              "dropped": list(mngr.store.dropped_steps)}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=WINDOW)
    p.add_argument("--ref-dir")
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    fault = os.environ.get("FAULT")
    install_fault(fault)
    preempt = os.environ.get("PREEMPT")
    result = run(args.dir, args.steps, seed=args.seed, resume=args.resume, ref_dir=args.ref_dir,
                 fault=fault, window=args.window, step_sleep=float(os.environ.get("STEP_SLEEP", 0)),
                 preempt_deadline=float(preempt) if preempt else None,
                 backpressure=os.environ.get("BACKPRESSURE", "block"))
    emit(ev="done", errors=result["errors"], dropped=result["dropped"])
    return 0


if __name__ == "__main__":
    sys.exit(main())


def restore_snapshot(directory, step: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Restore ``step`` through a read-only store (no lock) into a fresh TrainState."""
    from overlap_ckpt.manager import CheckpointManager
    from overlap_ckpt.storage import CheckpointStore

    store = CheckpointStore(directory, read_only=True)
    mngr = CheckpointManager(directory, save_interval_steps=INTERVAL, window=WINDOW, store=store)
    try:
        return snapshot(mngr.restore(step, target_state=make_state(seed)))
    finally:
        mngr.close()


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    if sorted(a) != sorted(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
               and np.ascontiguousarray(a[k]).tobytes() == np.ascontiguousarray(b[k]).tobytes() for k in a)


def launch(directory, *, steps: int = 18, env: dict | None = None, ref_dir=None, extra=(), prefix=()):
    """Start this worker as a subprocess (stdout/stderr piped); returns the Popen. ``prefix``:
    a command that runs it (the soak's ``unshare -rm sh -c ...`` for a tmpfs or a read-only root)."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    full = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("FAULT", "PREEMPT", "STEP_SLEEP", "BACKPRESSURE"):
        full.pop(k, None)
    full.update(env or {})
    cmd = [*prefix, sys.executable, os.path.abspath(__file__), "--dir", str(directory), "--steps", str(steps), *extra]
    if ref_dir is not None:
        cmd += ["--ref-dir", str(ref_dir)]
    return subprocess.Popen(cmd, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def events(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out
