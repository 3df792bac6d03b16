"""The random-fault soak (tests/faults/soak.py) in CI: a few faults of every kind, so the
soak's code path (fault set-up, both readers, the counters, the final line and the exit
status) is exercised on every run instead of only when someone soaks for an hour.

Why a count of iterations and not minutes: a slow CI machine then runs the same faults.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from . import soak

LINE = re.compile(r"^soak: [\d.]+ min, kills (\d+), faults \{(.*)\}, committed (\d+), restores verified "
                  r"(\d+) \(ours (\d+) \+ orbax (\d+)\), lost (\d+), wrong (\d+)$")


def test_soak_every_kind_once():
    pytest.importorskip("moto.server")
    proc = subprocess.run([sys.executable, "-m", "tests.faults.soak", "--iterations", str(len(soak.KINDS)),
                           "--seed", "7", "--quiet", "--each-kind-once"],
                          cwd=soak.REPO, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr[-3000:]  # one line, nothing else on stdout
    m = LINE.match(lines[0])
    assert m, lines[0]
    kills, faults, committed, total, ours, orbax, lost, wrong = m.groups()
    assert (lost, wrong) == ("0", "0") and proc.returncode == 0, lines[0] + proc.stderr[-3000:]
    assert all(f"'{k}': 1" in faults for k in soak.KINDS), faults
    assert int(kills) <= 1 and int(committed) > 0 and int(orbax) > 0 and int(ours) >= int(orbax)
    assert int(total) == int(ours) + int(orbax)
