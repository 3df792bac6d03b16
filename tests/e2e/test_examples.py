"""The example training scripts run end to end with tiny settings and resume."""

import os
import subprocess
import sys

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
