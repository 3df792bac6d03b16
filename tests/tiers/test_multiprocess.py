"""Two processes (jax.distributed + gloo on 127.0.0.1, FSDP over both): restore agrees on
the newest step complete on every process.

A reference job trains 18 steps (local tier every 2 steps, durable every 6): each process's
local tier holds steps 14 and 16, the durable tier 6 and 12. Then, on copies of its
directories:

* process 1's write of step 16 is torn (its directory never renamed): process 0's newest
  local step is newer than process 1's, and both must resume from 14, losses bitwise equal
  to the reference;
* process 1's local tier is wiped (a replaced host): both resume from durable step 12.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from e2e.test_multiprocess import free_port, run_processes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_worker.py")
STEPS = 18


def job(tmp_path, run, name, *extra):
    """Run the 2-process job on ``run``'s directories; per process, its JSON events."""
    port = free_port()
    results = run_processes([[sys.executable, WORKER, "--pid", str(pid), "--port", str(port),
                              "--dir", str(run / "durable"), "--local", str(run / "local"),
                              "--steps", str(STEPS), *extra] for pid in range(2)], tmp_path, name)
    out = []
    for code, log in results:
        assert code == 0, log[-4000:]
        out.append([json.loads(line) for line in log.splitlines() if line.startswith('{"ev"')])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiers_mp")
    events = job(tmp, tmp / "ref", "reference")
    losses = [{e["t"]: e["loss"] for e in ev if e["ev"] == "step"} for ev in events]
    assert losses[0] == losses[1] and sorted(losses[0]) == list(range(STEPS))
    for pid in range(2):
        assert sorted(os.listdir(tmp / "ref" / "local" / f"process_{pid}")) == ["14", "16"]
    assert sorted(n for n in os.listdir(tmp / "ref" / "durable") if n.isdigit()) == ["12", "6"]
    return tmp / "ref", losses[0]


def resume(tmp_path, reference, damage):
    ref, ref_losses = reference
    shutil.copytree(ref, tmp_path / "run")
    damage(tmp_path / "run")
    events = job(tmp_path, tmp_path / "run", "resume", "--resume")
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
