"""Python environments holding one Orbax release each, for the version matrix.

Why venvs and not one environment: the point is what a user pinned to another Orbax (or
to our oldest declared dependencies) gets, so each release must run in a process of its
own, importing that release. Each venv is built once and reused, under
``~/.cache/overlap_ckpt/venvs/<name>-<hash of its pins and Python>`` (``OVERLAP_CKPT_VENVS``
overrides the folder). It sees the main environment's packages (``--system-site-packages``)
and installs only its pins on top, which pip keeps in its cache: a build takes seconds, not
the minutes of a full install. A ``.complete`` marker is written last, so a build cut short
is rebuilt, never half used; building one removes the venvs of its older pins.

Environments whose pins the main environment already satisfies run there, without a venv.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parents[2]
# A cold build (pip cache empty) measured 28 s; 10x that before calling it failed.
BUILD_TIMEOUT_S = int(os.environ.get("OVERLAP_CKPT_VENV_TIMEOUT", "300"))
# The newest 0.11 and the newest release when this matrix was last brought up to date
# (2026-11). Bump NEWEST with each Orbax release; docs/compatibility.md says how.
NEWEST_0_11 = "0.11.40"
NEWEST = "0.12.8"


class EnvBuildError(RuntimeError):
    """A venv of the matrix could not be built (no network and a cold pip cache, a pin
    that does not resolve, a timeout)."""


# Builds that failed in this process: each test needing one reports the same error at once
# instead of spending another timeout on it.
_FAILED: dict[str, EnvBuildError] = {}


def declared_floors() -> dict[str, str]:
    """``{package: minimum}`` from pyproject.toml's ``dependencies``; every entry must be
    ``name>=version`` so that "the oldest version we allow" is a real, installable version."""
    with open(REPO / "pyproject.toml", "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    floors = {}
    for requirement in requirements:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(,.*)?", requirement)
        if match is None:
            raise ValueError(f"pyproject.toml dependency {requirement!r} has no '>=' floor; the "
                             "floor environment needs one for every dependency")
        floors[match.group(1)] = match.group(2)
    return floors


@dataclasses.dataclass(frozen=True)
class OrbaxEnv:
    """One environment of the matrix: a name and the exact versions it pins."""

    name: str
    pins: tuple[tuple[str, str], ...]

    @property
    def orbax_version(self) -> str:
        return dict(self.pins)["orbax-checkpoint"]

    def satisfied_here(self) -> bool:
        """True when the running interpreter already holds every pinned version."""
        for package, version in self.pins:
            try:
                if importlib.metadata.version(package) != version:
                    return False
            except importlib.metadata.PackageNotFoundError:
                return False
        return True

    def directory(self) -> pathlib.Path:
        key = repr((self.pins, sys.version_info[:2])).encode()
        root = pathlib.Path(os.environ.get("OVERLAP_CKPT_VENVS", "~/.cache/overlap_ckpt/venvs")).expanduser()
        return root / f"{self.name}-{hashlib.sha256(key).hexdigest()[:12]}"

    def python(self) -> str:
        """The interpreter to run this environment's scripts with, building the venv if needed."""
        if self.satisfied_here():
            return sys.executable
        venv = self.directory()
        if not (venv / ".complete").exists():
            if self.name in _FAILED:
                raise _FAILED[self.name]
            try:
                self._build(venv)
            except EnvBuildError as e:
                _FAILED[self.name] = e
                raise
        return str(venv / "bin" / "python")

    def _build(self, venv: pathlib.Path) -> None:
        for stale in venv.parent.glob(f"{self.name}-*"):  # older pins of this environment
            if re.fullmatch(rf"{re.escape(self.name)}-[0-9a-f]{{12}}", stale.name):
                shutil.rmtree(stale, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        requirements = [f"{package}=={version}" for package, version in self.pins]
        commands = [[sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                    [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                     "--disable-pip-version-check", *requirements]]
        for command in commands:
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                raise EnvBuildError(f"building the {self.name} venv ({' '.join(requirements)}) took over "
                                    f"{BUILD_TIMEOUT_S} s at {' '.join(command[:4])}...; check the network "
                                    "or pip cache, or raise OVERLAP_CKPT_VENV_TIMEOUT") from e
            if done.returncode != 0:
                raise EnvBuildError(f"building the {self.name} venv ({' '.join(requirements)}) failed "
                                    f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        (venv / ".complete").write_text(" ".join(requirements) + "\n")


def matrix() -> list[OrbaxEnv]:
    """The floor (every dependency at its declared minimum), the newest 0.11, the newest."""
    floors = declared_floors()
    return [OrbaxEnv("floor", tuple(sorted(floors.items()))),
            OrbaxEnv("orbax-newest-0.11", (("orbax-checkpoint", NEWEST_0_11),)),
            OrbaxEnv("orbax-newest", (("orbax-checkpoint", NEWEST),))]
