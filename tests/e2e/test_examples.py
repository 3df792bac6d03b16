"""The example training scripts run end to end with tiny settings and resume."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO


@pytest.mark.parametrize("script", ["train_lm.py", "train_nnx.py"])
def test_example_trains_and_resumes(script, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.join(REPO, "examples", script), "--steps", "12", "--interval", "4",
           "--window", "2", "--dir", str(tmp_path / "ckpt")]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "checkpoints [4, 8]" in first.stdout, first.stdout
    cmd[cmd.index("--steps") + 1] = "17"
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 8" in second.stdout and "checkpoints [8, 12, 16]" in second.stdout, second.stdout


def _local_steps(path):
    """The committed steps of a step directory (a step being written has a longer name)."""
    return {int(name) for name in os.listdir(path) if name.isdigit()} if os.path.isdir(path) else set()


def test_fsdp_example_resumes_after_a_kill(tmp_path):
    """examples/train_fsdp.py, 2 processes (started by the script) x 1 CPU device: it trains and
    checkpoints, resumes from the local tier with process 1's copy gone (from process 0's
    replica), is SIGKILLed (the whole process group) once it wrote newer local steps, and
    resumes from the newest step every process can restore."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    local, durable = tmp_path / "local", tmp_path / "ckpt"
    cmd = [sys.executable, os.path.join(REPO, "examples", "train_fsdp.py"), "--processes", "2",
           "--devices-per-process", "1", "--interval", "6", "--local-every", "2", "--window", "1",
           "--dir", str(durable), "--local-dir", str(local)]

    def run(steps, *more):
        proc = subprocess.run(cmd + ["--steps", str(steps), *more], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    # Local steps 6 and 8 (the window of step 10 would start after the last step), durable 6.
    out = run(10)
    assert "checkpoints [6, 8]" in out and "resumed" not in out, out

    # A replaced host: process 1's local tier is gone. Step 8 is on no durable storage, so the
    # resume below comes from the local tiers: process 1's shards from process 0's replica.
    shutil.rmtree(local / "process_1")
    job = subprocess.Popen(cmd + ["--steps", "100000"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not all(max(_local_steps(local / f"process_{p}"), default=0) >= 10 for p in (0, 1)):
            assert job.poll() is None, job.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no local step >= 10 within 240 s"
            time.sleep(0.1)
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # the launcher and both training processes
        except ProcessLookupError:  # all exited (the assertion above says why)
            pass
    out = job.communicate(timeout=60)[0]
    assert "[0] resumed from step 8" in out, out[-3000:]

    # Process p's shards of a step: in its own local tier or in its peer's replicas.
    def restorable(p):
        peer_replicas = local / f"process_{1 - p}" / "replicas" / f"process_{p}"
        return _local_steps(local / f"process_{p}") | _local_steps(peer_replicas)

    newest = max(restorable(0) & restorable(1) | _local_steps(durable))
    assert newest >= 10
    # Windows of 2 steps (the runs above: 1, quicker to compile on CPU): the step of each
    # checkpoint is captured over the 2 steps that follow it.
    out = run(newest + 4, "--window", "2")
    assert f"[0] resumed from step {newest}\n" in out, out
    listed = re.search(r"checkpoints \[([\d, ]+)\]", out)
    assert listed and int(listed.group(1).split(", ")[-1]) == newest + 2, out
