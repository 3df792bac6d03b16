"""Real multi-process jobs: 2 processes x 2 CPU devices, jax.distributed + gloo on 127.0.0.1.

Each test spawns tests/mp_worker.py processes (bounded by timeouts: a hang fails the test,
it never blocks the suite) and checks what they report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

from conftest import REPO

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")
TIMEOUT = 55  # per job, seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return e


def run_job(mode: str, tmp_path, *extra: str, nprocs: int = 2) -> list[tuple[int, str]]:
    """Start ``nprocs`` workers; returns (returncode, output) per process."""
    port = free_port()
    procs = []
    for pid in range(nprocs):
        cmd = [sys.executable, WORKER, mode, "--pid", str(pid), "--nprocs", str(nprocs),
               "--port", str(port), "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path), *extra]
        log = open(tmp_path / f"log_{mode}_{pid}.txt", "w+")
        procs.append((subprocess.Popen(cmd, env=env(2), stdout=log, stderr=subprocess.STDOUT), log))
    results = []
    try:
        for proc, log in procs:
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            results.append((proc.returncode, log.read()))
            log.close()
    return results


def run_restore(tmp_path, devices: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, WORKER, "restore", "--dir", str(tmp_path / "ckpt"),
                           "--out", str(tmp_path)], env=env(devices), capture_output=True,
                          text=True, timeout=TIMEOUT)


def tail(out: str) -> str:
    return "\n".join(l for l in out.splitlines() if not l.startswith(("W0", "I0")))[-4000:]


def test_two_processes_train_persist_and_restore_elsewhere(tmp_path):
    # A checkpoint written by one process, for the process-count check of restore(target=None).
    from overlap_ckpt.storage import CheckpointStore
    with CheckpointStore(tmp_path / "single") as store:
        store.save(1, {"w": np.arange(4, dtype=np.float32)})
    results = run_job("train", tmp_path, "--single-dir", str(tmp_path / "single"))
    for pid, (rc, out) in enumerate(results):
        assert rc == 0 and f"WORKER-OK train {pid}" in out, f"process {pid} rc={rc}\n{tail(out)}"
    r0, r1 = (json.loads((tmp_path / f"result_{p}.json").read_text()) for p in (0, 1))
    # The leaf replicated over all 4 devices is held (hence written) by process 0 only.
    assert (r0["replicated_shards"], r1["replicated_shards"]) == (1, 0)
    # Every other byte is split evenly: the processes own disjoint halves of the state.
    assert r0["owned_bytes"] > r1["owned_bytes"] > 0
    for r in (r0, r1):
        assert "written by 1 process(es); this job has 2" in r["numpy_restore_error"]
        assert "target shardings" in r["numpy_restore_error"]
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in (ckpt / "6" / "default").glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]
    # Restored by a single process with 4 devices (same mesh size) and with 1 device.
    for devices in (4, 1):
        done = run_restore(tmp_path, devices)
        assert f"WORKER-OK restore {devices}" in done.stdout, tail(done.stdout + done.stderr)


def test_killed_process_times_out_with_a_clear_error(tmp_path):
    results = run_job("kill", tmp_path, "--timeout", "6")
    rc0, out0 = results[0]
    assert rc0 == 0 and "WORKER-OK kill 0" in out0, tail(out0)
    assert results[1][0] == -9, f"process 1 should have been SIGKILLed: {results[1][0]}\n{tail(results[1][1])}"
    r0 = json.loads((tmp_path / "result_0.json").read_text())
    assert "process 1 did not finish writing step 6 within 6 s; the step was not committed" in r0["error"], r0
    assert r0["cause_type"] == "BarrierTimeoutError" and r0["missing"] == [1]
    assert r0["error_type"] == "CheckpointWriteError"
    assert 5 < r0["waited_s"] < 30
    # Nothing of step 6 is committed or left behind; step 3 is intact and restorable.
    assert r0["all_steps"] == [3] and r0["incomplete_steps"] == [] and r0["restored_3"]
