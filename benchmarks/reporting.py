"""Where a benchmark's report goes: ``<out>.json`` (every figure, for later analysis) and
``<out>.md`` (the table committed under ``benchmarks/results/``), and the table to stdout.

Both name the code they measured: the commit checked out, and whether the library or the
benchmarks differed from it. Why: a report read weeks later is only evidence for the code it
ran on, and reports without it had to be dated from git history
(``tests/e2e/test_results_index.py`` requires it of every kept report)."""

from __future__ import annotations

import json
import os
import subprocess

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def code_version() -> str:
    """``"<short commit>"``, plus ``" + uncommitted changes"`` where ``overlap_ckpt/`` or
    ``benchmarks/`` differ from it; ``"unknown (not a git checkout)"`` outside one."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "overlap_ckpt", "benchmarks")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit + (" + uncommitted changes" if dirty else "")


def stamped(markdown: str, version: str) -> str:
    """``markdown`` with a line naming the code under its title (the first line)."""
    title, _, rest = markdown.partition("\n")
    return f"{title}\n\nCode: commit `{version}`.\n{rest}"


def publish(report: dict, markdown: str, out: str | None) -> None:
    """Print ``markdown`` and write both files, naming the code: the run's own where the
    report already names it (a table recomputed from an earlier run's JSON), else this
    checkout's."""
    version = report.get("code") or code_version()
    markdown = stamped(markdown, version)
    print(markdown)
    if out:
        with open(out + ".json", "w") as f:
            json.dump({**report, "code": version}, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(markdown)
