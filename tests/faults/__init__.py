"""Reliability suite of overlap_ckpt: SIGKILL at every stage, injected I/O faults, corruption
after the fact, crafted metadata, a memory soak and graceful shutdown on SIGTERM.

``OUTCOMES`` collects one row per fault tried (filled by the tests, printed at the end of
the run by the hook in ``conftest.py``).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
#: fault -> {"count": runs, "lost": committed steps lost, "wrong": wrong states returned, "outcome": text}
OUTCOMES: dict[str, dict] = {}


def record(fault: str, *, lost: int = 0, wrong: int = 0, outcome: str = "ok", runs: int = 1) -> None:
    """Add one run's counts (``runs=0``: more counts of a run already recorded). Call it
    before asserting on them, so the report shows what a failing run lost."""
    with _lock:
        row = OUTCOMES.setdefault(fault, {"count": 0, "lost": 0, "wrong": 0, "outcome": outcome})
        row["count"] += runs
        row["lost"] += lost
        row["wrong"] += wrong
        row["outcome"] = outcome
