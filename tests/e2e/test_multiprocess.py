"""Real multi-process jobs: 2 processes x 2 CPU devices, jax.distributed + gloo on 127.0.0.1.

Each test spawns tests/mp_worker.py processes (bounded by timeouts: a hang fails the test,
it never blocks the suite) and checks what they report.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_worker.py")
TIMEOUT = 55  # per job, seconds
FAULT_FIRED = "FAULT-HOOK-FIRED"  # printed by mp_worker's fault hook right before its SIGKILL


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


def run_processes(cmds: list[list[str]], tmp_path, name: str, devices: int = 2) -> list[tuple[int, str]]:
    """Run one process per command line together, each with ``devices`` CPU devices; returns
    (returncode, output) of each. A process still running after TIMEOUT is killed (a hang
    fails, never blocks the suite)."""
    procs = []
    for pid, cmd in enumerate(cmds):
        log = open(tmp_path / f"log_{name}_{pid}.txt", "w+")
        procs.append((subprocess.Popen(cmd, env=env(devices), stdout=log, stderr=subprocess.STDOUT), log))
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


def run_job(mode: str, tmp_path, *extra: str, nprocs: int = 2) -> list[tuple[int, str]]:
    """Start ``nprocs`` mp_worker processes; returns (returncode, output) per process."""
    port = free_port()
    return run_processes([[sys.executable, WORKER, mode, "--pid", str(pid), "--nprocs", str(nprocs),
                           "--port", str(port), "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path),
                           *extra] for pid in range(nprocs)], tmp_path, mode)


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
    # Killed by its own fault hook mid-persist (the harness's kill at TIMEOUT is also -9,
    # hence the line the hook prints right before it kills).
    rc1, out1 = results[1]
    assert rc1 == -9 and FAULT_FIRED in out1, f"process 1 rc={rc1}\n{tail(out1)}"
    r0 = json.loads((tmp_path / "result_0.json").read_text())
    assert "process 1 did not finish writing step 6 within 6 s; the step was not committed" in r0["error"], r0
    assert r0["cause_type"] == "BarrierTimeoutError" and r0["missing"] == [1]
    assert r0["error_type"] == "CheckpointWriteError"
    # Nothing of step 6 is committed or left behind; step 3 is intact and restorable.
    assert r0["all_steps"] == [3] and r0["incomplete_steps"] == [] and r0["restored_3"]


# -- one process of a 2-process job killed mid-checkpoint ----------------------------------------

FAULT_WORKER = os.path.join(HERE, "mp_fault_worker.py")
# (process killed, storage stage of its persist of step 12 after which its timer starts):
# process 1 dies while writing, in the data barrier or in the commit barrier; process 0 (the
# primary, which also hosts jax.distributed's coordination service) while merging/committing.
KILL_POINTS = [(1, "array_write"), (1, "data_written"), (0, "data_written"), (0, "metadata_written"),
               (0, "before_commit"), (0, "committed")]
FAULT_RUNS = int(os.environ.get("OVERLAP_MP_FAULT_RUNS", "3"))
FAULT_SEED = os.environ.get("OVERLAP_MP_FAULT_SEED", "0")
# What jax.distributed prints when it aborts a process whose coordination service is gone.
JAX_SERVICE_LOST = "JAX distributed service detected fatal errors"


def run_fault_job(tmp_path, name: str, *extra: str) -> list[tuple[int, str]]:
    port = free_port()
    return run_processes([[sys.executable, FAULT_WORKER, "--pid", str(pid), "--port", str(port),
                           "--dir", str(tmp_path / "ckpt"), "--out", str(tmp_path), *extra]
                          for pid in (0, 1)], tmp_path, name)


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Synchronous snapshots (gathered) at versions 3..15 of an uninterrupted 2-process run."""
    out = tmp_path_factory.mktemp("mp_refs")
    results = run_fault_job(out, "refs", "--steps", "16", "--refs")
    assert all(rc == 0 for rc, _ in results), [tail(o) for _, o in results]
    return dict(np.load(out / "refs.npz"))


def check_steps(directory, refs, steps):
    """Our reader and stock Orbax list exactly ``steps`` and restore each bitwise."""
    import orbax.checkpoint as ocp
    from overlap_ckpt.storage import CheckpointStore

    with CheckpointStore(directory, read_only=True) as store:
        assert store.all_steps() == steps and store.verify().ok
        ours = {s: store.restore(s)[0] for s in steps}
    orbax = ocp.CheckpointManager(str(directory))
    try:
        assert list(orbax.all_steps()) == steps
        theirs = {s: orbax.restore(s) for s in steps}
    finally:
        orbax.close()
    for s in steps:
        for reader, tree in (("ours", ours[s]), ("orbax", theirs[s])):
            leaves = jax.tree.leaves((tree["params"], tree["opt_state"]))
            for i, leaf in enumerate(leaves):
                want = refs[f"v{s}_{i}"]
                assert np.asarray(leaf).tobytes() == want.tobytes(), f"{reader}: step {s} leaf {i}"
            assert int(np.asarray(tree["extras"]["step"])) == s


@pytest.mark.parametrize("run", range(FAULT_RUNS))
def test_sigkill_one_process_mid_checkpoint_then_resume_both(tmp_path, refs, run):
    """SIGKILL of one process at a random point of the checkpoint of step 12: the survivor
    reports a clear error (or nothing, if the step got fully committed first) and exits
    instead of hanging; every reader sees step 12 whole or not at all; a restart of both
    resumes from the newest committed step and writes the uninterrupted run's states."""
    rng = random.Random(f"{FAULT_SEED}:{run}")
    victim = run % 2  # both roles are hit whenever there are two runs or more
    stage = rng.choice([s for p, s in KILL_POINTS if p == victim])
    delay = round(rng.uniform(0.0, 0.3), 3)
    what = f"SIGKILL process {victim} {delay} s after {stage!r} of step 12"
    results = run_fault_job(tmp_path, "fault", "--steps", "13", "--kill-pid", str(victim),
                            "--kill-stage", stage, "--kill-step", "12", "--kill-delay", str(delay))
    (rc_v, out_v), (rc_s, out_s) = results[victim], results[1 - victim]
    assert rc_v == -9 and FAULT_FIRED in out_v, f"{what}: victim rc={rc_v}\n{tail(out_v)}"
    # The survivor reports and exits. When the victim was process 0, jax.distributed's
    # client aborts the survivor (SIGABRT) once it notices that the service process 0 hosted
    # is gone, with its own fatal message, at a moment JAX does not bound: before or after
    # the survivor reported. Either way it does not hang; what is on storage is checked below.
    aborted_by_jax = victim == 0 and rc_s == -signal.SIGABRT and JAX_SERVICE_LOST in out_s
    assert aborted_by_jax or (rc_s in (0, -signal.SIGABRT) and f"WORKER-OK {1 - victim}" in out_s), \
        f"{what}: survivor rc={rc_s}\n{tail(out_s)}"
    if victim == 1:
        assert rc_s == 0, f"{what}: survivor rc={rc_s}\n{tail(out_s)}"
    result = tmp_path / f"result_{1 - victim}.json"
    survivor = json.loads(result.read_text()) if result.exists() else {}
    from overlap_ckpt.storage import CheckpointStore
    with CheckpointStore(tmp_path / "ckpt", read_only=True) as store:
        steps = store.all_steps()
    assert steps in ([3, 6, 9], [3, 6, 9, 12]), (what, steps)
    if not survivor:
        assert aborted_by_jax, (what, "the survivor neither reported nor was aborted by jax.distributed")
    elif "error" in survivor:  # a clear error naming the step and the dead process
        assert survivor["error_type"] == "CheckpointWriteError" and survivor["step"] == 12, (what, survivor)
        assert survivor["cause_type"] == "BarrierTimeoutError" and survivor["missing"] == [victim], (what, survivor)
    else:  # no error only when the step was fully committed before the kill
        assert 12 in steps, (what, survivor)
    check_steps(tmp_path / "ckpt", refs, steps)
    resumed = run_fault_job(tmp_path, "resume", "--steps", "16", "--resume")
    assert all(rc == 0 for rc, _ in resumed), [tail(o) for _, o in resumed]
    assert json.loads((tmp_path / "result_0.json").read_text())["start"] == steps[-1]
    check_steps(tmp_path / "ckpt", refs, [3, 6, 9, 12, 15])


def test_a_step_that_shards_a_replicated_leaf_is_checkpointed_exactly_on_every_process(tmp_path):
    """Two processes, a jit without out_shardings that shards the replicated biases after
    the first step (tests/e2e/mp_placement_worker.py): every checkpoint equals each
    process's synchronous shards. Planned on the state at prepare, process 0 discarded
    every window ("covers 8 of the 16 elements") and process 1 failed in the replay."""
    port = free_port()
    worker = os.path.join(HERE, "mp_placement_worker.py")
    results = run_processes([[sys.executable, worker, "--pid", str(pid), "--port", str(port),
                              "--dir", str(tmp_path / "ckpt")] for pid in range(2)], tmp_path, "placement")
    for pid, (code, out) in enumerate(results):
        assert code == 0 and f"PLACEMENT-OK {pid}" in out, out[-3000:]
