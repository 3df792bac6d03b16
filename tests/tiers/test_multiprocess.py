"""Two processes (jax.distributed + gloo on 127.0.0.1, FSDP over both): restore agrees on
the newest step complete on every process.

A reference job trains 18 steps (local tier every 2 steps, durable every 6): each process's
local tier holds steps 14 and 16, the durable tier 6 and 12. Then, on copies of its
directories:

* process 1's write of step 16 is torn (its directory never renamed): process 0's newest
  local step is newer than process 1's, and both must resume from 14, losses bitwise equal
  to the reference;
* process 1's local tier is wiped (a replaced host): both resume from durable step 12.

With peer replicas (``replicas=1``: each process also holds the other's local steps) a job
is stopped at the end of step 17, once its checkpoints are written and replicated (window
18 open): local steps 14 and 16 on each process and as replicas on the other, durable 6
and 12. Then, on copies:

* process 1 SIGKILLed and its host lost (its directory, replicas included, wiped): both
  resume from 16, process 1's shards coming from process 0's replica;
* both hosts lost: both resume from durable step 12;
* process 1's host lost and process 0's replica of its step 16 truncated (a torn copy):
  both resume from 14, never from the torn 16;
* process 1's own step 16 torn: process 0's newest is newer than process 1's own, both
  resume from 16 with process 1's shards taken from the replica;
* SIGTERM: every process copies local step 16 to the durable tier before it exits; a
  replacement job with empty local tiers resumes from it.

Each resume trains to step 18; its losses must be bitwise those of the reference job.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import once_per_run
from e2e.test_multiprocess import TIMEOUT, env, free_port, run_processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_worker.py")
STEPS = 18
REPLICAS = ("--replicas", "1")


def commands(run, *extra):
    """The command lines of the 2-process job on ``run``'s directories."""
    port = free_port()
    return [[sys.executable, WORKER, "--pid", str(pid), "--port", str(port), "--dir", str(run / "durable"),
             "--local", str(run / "local"), "--steps", str(STEPS), *extra] for pid in range(2)]


def job(tmp_path, run, name, *extra, exit_code=0):
    """Run the 2-process job on ``run``'s directories; per process, its JSON events (and
    its log, when it is to end with a signal's ``exit_code``)."""
    results = run_processes(commands(run, *extra), tmp_path, name)
    out = []
    for code, log in results:
        assert code == exit_code, log[-4000:]
        out.append([json.loads(line) for line in log.splitlines() if line.startswith('{"ev"')])
    return out if exit_code == 0 else [log for _, log in results]


def steps_in(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One reference job for the whole test run (both xdist workers): tests resume on copies."""
    return once_per_run(tmp_path_factory, "tiers_mp", reference_job)


def reference_job(tmp):
    events = job(tmp, tmp / "ref", "reference")
    losses = [{e["t"]: e["loss"] for e in ev if e["ev"] == "step"} for ev in events]
    assert losses[0] == losses[1] and sorted(losses[0]) == list(range(STEPS))
    for pid in range(2):
        assert sorted(os.listdir(tmp / "ref" / "local" / f"process_{pid}")) == ["14", "16"]
    assert sorted(n for n in os.listdir(tmp / "ref" / "durable") if n.isdigit()) == ["12", "6"]
    return tmp / "ref", losses[0]


def resume(tmp_path, reference, damage, source=None, *extra):
    """Resume both processes on a copy of ``source``'s directories (the reference run's by
    default) after ``damage``; returns the step they resumed from, checking their losses."""
    ref, ref_losses = reference
    shutil.copytree(source or ref, tmp_path / "run")
    damage(tmp_path / "run")
    events = job(tmp_path, tmp_path / "run", "resume", "--resume", *extra)
    starts = [next(e["step"] for e in ev if e["ev"] == "resumed") for ev in events]
    assert starts[0] == starts[1], starts
    for ev in events:
        assert {e["t"]: e["loss"] for e in ev if e["ev"] == "step"} == \
            {t: ref_losses[t] for t in range(starts[0], STEPS)}
    return starts[0]


def test_processes_agree_when_one_has_a_newer_local_step(tmp_path, reference):
    def tear(run):
        p1 = run / "local" / "process_1"
        os.rename(p1 / "16", p1 / "16.orbax-checkpoint-tmp-1")

    assert resume(tmp_path, reference, tear) == 14


def test_a_wiped_local_tier_resumes_everyone_from_durable(tmp_path, reference):
    assert resume(tmp_path, reference, lambda run: shutil.rmtree(run / "local" / "process_1")) == 12


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """One killed job for the whole test run (both xdist workers): tests resume on copies."""
    return once_per_run(tmp_path_factory, "tiers_mp_killed", killed_job)


def killed_job(tmp):
    """A replicas=1 job whose process 1 is SIGKILLed at the end of step 17; the scheduler
    then kills process 0 too (the job restarts)."""
    log = tmp / "log_killed.txt"
    with open(log, "w") as out:
        procs = [subprocess.Popen(cmd, env=env(2), stdout=out, stderr=subprocess.STDOUT)
                 for cmd in commands(tmp / "run", *REPLICAS, "--kill-at", "17")]
        try:
            procs[1].wait(timeout=TIMEOUT)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert procs[1].returncode == -signal.SIGKILL, log.read_text()[-4000:]
    local = tmp / "run" / "local"
    for pid, peer in ((0, 1), (1, 0)):
        assert steps_in(local / f"process_{pid}") == [14, 16]
        assert steps_in(local / f"process_{pid}" / "replicas" / f"process_{peer}") == [14, 16]
    assert steps_in(tmp / "run" / "durable") == [6, 12]
    return tmp / "run"


def lose_host(run, pid):
    shutil.rmtree(run / "local" / f"process_{pid}")


def test_a_lost_host_resumes_from_the_peer_replica(tmp_path, reference, killed):
    assert resume(tmp_path, reference, lambda run: lose_host(run, 1), killed, *REPLICAS) == 16


def test_every_local_tier_lost_resumes_from_durable(tmp_path, reference, killed):
    def lose_both(run):
        lose_host(run, 0)
        lose_host(run, 1)

    assert resume(tmp_path, reference, lose_both, killed, *REPLICAS) == 12


def test_a_torn_replica_is_never_chosen(tmp_path, reference, killed):
    def lose_host_and_tear_its_replica(run):
        lose_host(run, 1)
        replica = run / "local" / "process_0" / "replicas" / "process_1" / "16"
        data = max((p for p in replica.rglob("*") if p.is_file() and p.parent.name == "d"),  # array data
                   key=lambda p: p.stat().st_size)
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)

    assert resume(tmp_path, reference, lose_host_and_tear_its_replica, killed, *REPLICAS) == 14


def test_a_step_torn_on_one_process_is_taken_from_its_replica(tmp_path, reference, killed):
    def tear(run):
        p1 = run / "local" / "process_1"
        os.rename(p1 / "16", p1 / "16.orbax-checkpoint-tmp-1")

    assert resume(tmp_path, reference, tear, killed, *REPLICAS) == 16


def test_sigterm_promotes_the_newest_local_step_on_every_process(tmp_path, reference):
    run = tmp_path / "preempted"
    logs = job(tmp_path, run, "preempted", *REPLICAS, "--preempt-at", "17", exit_code=143)
    for log in logs:
        assert "local step 16 copied to the durable tier" in log, log[-4000:]
    assert steps_in(run / "durable") == [12, 16]
    # The replacement job runs on other hosts: no local tier at all.
    assert resume(tmp_path, reference, lambda r: shutil.rmtree(r / "local"), run, *REPLICAS) == 16
