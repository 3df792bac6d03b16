"""The ``overlap-ckpt`` command line: demo, inspect, verify, and its error handling."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, once_per_run


def cli(*args, timeout=600):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "overlap_ckpt.tools.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_demo(directory):
    d = directory / "demo"
    r = cli("demo", "--dir", d, "--steps", 40, "--interval", 8, "--window", 2, "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resume verified: bitwise identical losses" in r.stdout
    assert "Traceback" not in r.stderr
    return d, r.stdout


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    """One demo run for the whole test run (both xdist workers): the tests only read it."""
    return once_per_run(tmp_path_factory, "cli-demo", run_demo)


@pytest.mark.slow
def test_demo_summary(demo_dir):
    _, out = demo_dir
    assert "demo directory:" in out
    assert "killed at step" in out and "resumed from step" in out
    assert "per window step" in out and "MB/s" in out


@pytest.mark.slow
def test_inspect_lists_steps(demo_dir):
    d, _ = demo_dir
    r = cli("inspect", d)
    assert r.returncode == 0, r.stderr
    for step in (24, 32):
        assert any(line.split()[:2] == [str(step), "complete"] for line in r.stdout.splitlines()), r.stdout
    assert "leaves" in r.stdout and "params" in r.stdout and "opt_state" in r.stdout


@pytest.mark.slow
def test_verify_good_then_corrupt(demo_dir, tmp_path):
    d = tmp_path / "demo"
    shutil.copytree(demo_dir[0], d)  # the byte flipped below stays out of the shared run
    r = cli("verify", d)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FAULT" not in r.stdout and "OK" in r.stdout
    latest = max(int(n) for n in os.listdir(d) if n.isdigit())
    assert latest == 32  # the window of step 40 would end at step 40, past the last step (39)
    r = cli("verify", d, "--step", latest)
    assert r.returncode == 0 and f"step {latest}: OK" in r.stdout

    # flip a byte in the largest data file of the latest step
    files = [os.path.join(root, f) for root, _, fs in os.walk(d / str(latest)) for f in fs
             if f not in ("_METADATA", "_CHECKPOINT_METADATA", "_overlap_ckpt.json",
                          "commit_success.txt", "manifest.ocdbt") and "/d/" in os.path.join(root, f)]
    assert files, list(os.walk(d / str(latest)))
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        data = bytearray(f.read())
        pos = len(data) // 2
        data[pos] ^= 0xFF
        f.seek(0)
        f.write(data)
    r = cli("verify", d)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"step {latest}: FAULT" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_unknown_flag_exits_2(tmp_path):
    r = cli("inspect", tmp_path, "--bogus")
    assert r.returncode == 2
    assert "usage:" in r.stderr


def test_not_a_checkpoint_dir(tmp_path):
    (tmp_path / "readme.txt").write_text("hello")
    for cmd in ("inspect", "verify"):
        r = cli(cmd, tmp_path)
        assert r.returncode == 1, (cmd, r.stdout, r.stderr)
        assert "not a checkpoint directory" in r.stderr
        assert "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_missing_dir(tmp_path):
    r = cli("verify", tmp_path / "nope")
    assert r.returncode == 1 and "no such directory" in r.stderr and "Traceback" not in r.stderr


def test_demo_refuses_foreign_nonempty_dir(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    r = cli("demo", "--dir", tmp_path, "--quiet")
    assert r.returncode == 1 and "not empty" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "keep.txt").exists()
