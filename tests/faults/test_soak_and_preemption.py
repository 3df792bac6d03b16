"""Memory soak (thousands of steps, K cycling 1..3) and graceful shutdown on SIGTERM.

The soak runs in a subprocess so its RSS is its own. Length: ``OVERLAP_SOAK_STEPS`` steps
per window size (default 600, i.e. 199 checkpoint windows each), a count rather than a duration so
that a slow machine runs the same test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from overlap_ckpt.storage import CheckpointStore

from . import record, worker

SOAK = textwrap.dedent(r"""
    import gc, json, os, sys, time
    sys.path.insert(0, sys.argv[3])
    import worker
    from overlap_ckpt.manager import CheckpointManager

    root, n_steps = sys.argv[1], int(sys.argv[2])
    page = os.sysconf("SC_PAGE_SIZE")
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    train_step = worker._train_step()
    out = []
    for k in (1, 2, 3):  # a new manager per K
        d = os.path.join(root, f"k{k}")
        samples, steps = [], 0
        with CheckpointManager(d, save_interval_steps=3, window=k, max_to_keep=2) as mngr:
            state = mngr.prepare(worker.make_state(k))
            while steps < n_steps:
                x, y = worker.batch(0, steps)
                state, loss = train_step(state, x, y)
                state = mngr.step(state)
                steps += 1
                time.sleep(0.003)  # paces the loop so that most checkpoints commit
                if steps % 60 == 0:
                    gc.collect()
                    samples.append((len(mngr.store.history), rss()))
            mngr.wait_until_finished()
            report = mngr.store.verify()
            assert report.ok, str(report)
            ckpts = len(mngr.store.history)
            verified = len(report.steps)
        out.append({"k": k, "steps": steps, "checkpoints": ckpts, "dropped": len(mngr.skipped_steps()),
                    "verified": verified, "samples": samples})
    print(json.dumps(out))
""")


def test_soak_rss_flat(tmp_path):
    n_steps = int(os.environ.get("OVERLAP_SOAK_STEPS", "600"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SOAK, str(tmp_path), str(n_steps),
                           os.path.dirname(os.path.abspath(worker.__file__))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    parts, worst = [], 0.0
    for run in runs:
        samples = run["samples"]
        n = len(samples)
        # Every window is committed or reported skipped, never silently lost (the window of
        # version V reads the input of step V: versions 3, 6, ... up to steps - 1).
        assert n >= 6 and run["checkpoints"] >= 20, run
        assert run["checkpoints"] + run["dropped"] == (run["steps"] - 1) // 3, run
        third = n // 3
        mid, last = samples[third:2 * third], samples[2 * third:]
        mid_rss = sorted(r for _, r in mid)[len(mid) // 2]
        last_rss = sorted(r for _, r in last)[len(last) // 2]
        ckpts = max(1, last[len(last) // 2][0] - mid[len(mid) // 2][0])
        growth = (last_rss - mid_rss) / 2**20
        worst = max(worst, growth)
        parts.append(f"K={run['k']}: {run['steps']} steps, {run['checkpoints']} ckpts "
                     f"({run['dropped']} dropped), RSS {growth:+.2f} MiB over {ckpts} ckpts")
    outcome = "; ".join(parts) + "; all committed steps verify"
    record("soak (RSS flat, all steps verify)", outcome=outcome)
    print(outcome)
    assert worst < 4, (outcome, runs)


def _wait_for(proc, pred, timeout=120):
    lines, t_end = [], time.monotonic() + timeout
    while time.monotonic() < t_end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        if pred(ev):
            return lines
    raise AssertionError("worker never reached the expected point:\n" + "".join(lines[-20:]))


def test_sigterm_drains_and_reports_last_committed_step(tmp_path):
    root = tmp_path / "ck"
    proc = worker.launch(root, steps=100000, env={"PREEMPT": "20", "STEP_SLEEP": "0.01"})
    try:
        lines = _wait_for(proc, lambda e: e.get("ev") == "commit" and e["step"] >= 12)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    evs = worker.events("".join(lines) + out)
    assert proc.returncode == 143, err[-2000:]
    report = [l for l in err.splitlines() if l.startswith("overlap_ckpt: SIGTERM")]
    assert report and "drained" in report[0], err[-2000:]
    reported = int(report[0].split("last committed step ")[1].split()[0])
    committed = [e["step"] for e in evs if e["ev"] == "commit"]
    last_step = max(e["t"] for e in evs if e["ev"] == "step")
    with CheckpointStore(root) as store:  # lock released (or taken over): a new job can start
        assert store.latest_step() == reported and store.incomplete_steps() == []
        assert store.verify().ok
    assert reported >= max(committed)  # nothing committed before SIGTERM was lost
    assert reported > last_step - 2 * worker.INTERVAL  # the last submitted window was finished
    # Resume from it: the losses are those the interrupted run computed, bitwise.
    losses = {e["t"]: e["loss"] for e in evs if e["ev"] == "step"}
    result = worker.run(root, min(last_step + 1, reported + 6), resume=True)
    assert result["start"] == reported
    for t, bits in result["losses"].items():
        assert bits == losses[t], t
    record("SIGTERM mid-run (graceful shutdown, deadline 20 s)", outcome=report[0])


def test_sigterm_deadline_passes_with_slow_disk(tmp_path):
    root = tmp_path / "ck"
    proc = worker.launch(root, steps=100000, env={"PREEMPT": "0.5", "STEP_SLEEP": "0.01",
                                                   "FAULT": "sleep:data_written:+8:30"})
    try:
        lines = _wait_for(proc, lambda e: e.get("ev") == "slow_begin")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    report = [l for l in err.splitlines() if l.startswith("overlap_ckpt: SIGTERM")]
    assert report and "deadline passed" in report[0] and "last committed step 4" in report[0], err[-2000:]
    with CheckpointStore(root) as store:  # the dead writer's lock is taken over
        assert store.latest_step() == 4
        assert store.verify().ok
    record("SIGTERM with a stuck persist (deadline 0.5 s)", outcome=report[0])
