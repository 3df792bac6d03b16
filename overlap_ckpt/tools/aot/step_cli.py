"""``overlap-ckpt aot --step module:function``: a user's own step, named on the command line.

``function()`` is called with no arguments and returns what the user would pass to
``CheckpointManager.compile_ahead`` (and, for NNX, to ``prepare``): an
:class:`overlap_ckpt.aot.UserStep` or a tuple ``(step, args[, kwargs])``. Why no argument
(not the target's mesh): the function is the user's own set-up code, run as it runs in
training, on this machine's devices; the report moves its arguments onto the target
(:mod:`overlap_ckpt.aot.placement`). The report is the one ``CheckpointManager.aot_report``
makes (:func:`overlap_ckpt.aot.report_step`), with ``window="auto"`` unless ``--k`` is given.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable, Sequence

from ...aot.step_report import StepError, StepReport, UserStep, report_step
from ...aot.targets import Target
from ...manager.copy_schedule import CopyScheduleHints


def load_step(spec: str) -> UserStep:
    """``module:function`` (importable, the current directory first on the path) or
    ``path/to/file.py:function``, called with no arguments."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise StepError(f"--step takes module:function or path/to/file.py:function, got {spec!r}")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise StepError(f"--step {spec}: no file {where}")
        name_here = os.path.splitext(os.path.basename(where))[0]
        found = importlib.util.spec_from_file_location(name_here, where)
        module = importlib.util.module_from_spec(found)
        sys.modules[name_here] = module  # as an import does: dataclasses (Flax modules) look their module up
        found.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise StepError(f"--step {spec}: cannot import {where} ({e}); run from the directory it is "
                            "importable from, or give path/to/file.py:function") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise StepError(f"--step {spec}: {where} has no function {name!r}")
    return UserStep.of(function())


def parse_mesh_shape(text: str | None) -> dict[str, int] | None:
    """``data=1,fsdp=4`` -> ``{"data": 1, "fsdp": 4}``."""
    if not text:
        return None
    try:
        return {name.strip(): int(size) for name, size in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise StepError(f"--mesh-shape takes axis=size pairs separated by commas (data=1,fsdp=4), got {text!r}"
                        ) from None


def step_report(user: UserStep, target: Target, *, ks: Sequence[int] | None, intervals: Sequence[int],
                copy_hints: bool, mesh_shape: dict[str, int] | None, log: Callable[[str], None]) -> StepReport:
    """The report of ``user`` (:func:`load_step`), as ``CheckpointManager.aot_report`` makes it."""
    return report_step(user, target, ks=ks, window="auto", intervals=intervals,
                       hints=CopyScheduleHints() if copy_hints else None, mesh_shape=mesh_shape, log=log)
