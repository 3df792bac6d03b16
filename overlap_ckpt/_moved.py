"""Module paths that moved when the package was laid out by concept, kept importable.

``overlap_ckpt.autok``, ``overlap_ckpt.peers``, ``overlap_ckpt.doors.orbax`` and the other
old paths below still import, as stand-in modules that forward each name to where it lives
now, with a ``DeprecationWarning`` naming the new path (one release, as optax's
``_src/deprecations.py`` keeps moved names). A stand-in forwards reads only: a test that
replaces a module attribute must replace it where it lives now.

``overlap_ckpt.preemption`` is a public path, not a deprecated one: it forwards silently.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

# old path -> the modules its names live in now (searched in order), and whether it warns
MOVED: dict[str, tuple[tuple[str, ...], bool]] = {
    "overlap_ckpt.preemption": (("overlap_ckpt.manager.preemption",), False),
    "overlap_ckpt.autok": (("overlap_ckpt.costmodel.window", "overlap_ckpt.manager.window_choice"), True),
    "overlap_ckpt.compile_ahead": (("overlap_ckpt.manager.compile_ahead",), True),
    "overlap_ckpt.copy_schedule": (("overlap_ckpt.manager.copy_schedule",), True),
    "overlap_ckpt.host_budget": (("overlap_ckpt.manager.host_budget",), True),
    "overlap_ckpt.save_tree": (("overlap_ckpt.manager.save_tree",), True),
    "overlap_ckpt.peers": (("overlap_ckpt.tiers.peers",), True),
    "overlap_ckpt.replica_transport": (("overlap_ckpt.tiers.transport",), True),
    "overlap_ckpt.tier_restore": (("overlap_ckpt.tiers.restore",), True),
    "overlap_ckpt.doors.orbax": (("overlap_ckpt.orbax_handler.handler",), True),
    "overlap_ckpt.aot.gpu_specs": (("overlap_ckpt.costmodel.gpu_specs",), True),
    "overlap_ckpt.aot.calibrate": (("overlap_ckpt.tools.aot.calibrate", "overlap_ckpt.costmodel.hardware"), True),
    **{f"overlap_ckpt.aot.{name}": ((f"overlap_ckpt.tools.aot.{name}",), True)
       for name in ("benchmark", "lm_step", "cpu_check", "device_check")},
    # The report's markdown went back down to aot when CheckpointManager.aot_report began to
    # render it (the manager's floor is below the command's).
    "overlap_ckpt.aot.report": (("overlap_ckpt.aot.markdown",), True),
    "overlap_ckpt.tools.aot.report": (("overlap_ckpt.aot.markdown",), True),
}


class _StandIn(types.ModuleType):
    """An old module path: each name read is looked up where it lives now."""

    def __init__(self, name: str, targets: tuple[str, ...], warn: bool):
        super().__init__(name, f"Moved: see {', '.join(targets)}.")
        self._targets = targets
        self._warn = warn

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                if self._warn:
                    warnings.warn(f"{self.__name__}.{attr} moved to {target}.{attr}; the old path goes in the "
                                  "next release", DeprecationWarning, stacklevel=2)
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(self._targets)}) has no "
                             f"attribute {attr!r}")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self._targets for n in dir(importlib.import_module(t)) if not n.startswith("_")})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths and makes their stand-ins. First in ``sys.meta_path``: a file left
    at an old path (an older install, an editable install of another checkout) must not be
    imported beside the module that replaced it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StandIn(spec.name, *MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Let the old paths import (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
