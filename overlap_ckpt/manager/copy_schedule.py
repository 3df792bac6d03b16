"""Opt-in on GPUs: start the last window phase's host copy at the top of the step.

Why: XLA:GPU starts a packed outbox's host copy where its own estimate of the copy's latency
runs out, after 0.57-0.72 of the step's compute, past the backward pass, although the copy
reads the step's inputs (an H200's profiler trace of the 1B LM; compile-only H100 for the
20M-1B LMs). The step then waits for most of the copy: K=1 cost 0.15-0.17 s of a 0.24 s
step. Told that the copy takes long (a profile-guided latency estimation profile, PGLE,
costing its ``copy-start``), the scheduler starts it at the top and the copy hides under
the step: 0.00-0.03 s (benchmarks/results/gpu_h200_1b_copy_schedule.md).

How the hint reaches the user's program: XLA reads PGLE profiles from the directory its
option ``xla_gpu_pgle_profile_file_or_directory_path`` names, one file per program, named by
the program's fingerprint before scheduling. The user's ``jax.jit`` takes that option
(:meth:`CopyScheduleHints.compiler_options`); ``compile_ahead`` compiles each last-phase
variant once on the side to learn its fingerprint and copies, writes the profile, then
compiles it for real (:meth:`CopyScheduleHints.prepare`). A program without a profile there
(the plain step, the phases that ship gradients) compiles as it would without the option.

The costs, why it is opt-in: the packed outbox then lives in device memory through the
forward and backward passes (+ the outbox's bytes: +9.6 GiB for the 1B LM's K=1), the last
phases compile twice (in the background), and XLA logs a warning for every instruction the
profile does not name when it compiles a hinted program. The phases that also ship
gradients get no hint: there it moved some state copies later (compile-only H100, 20M LM).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from typing import Any, Iterable, Mapping

from ..core.ticket import WindowTicket

log = logging.getLogger(__name__)

PGLE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
# The cost each hinted copy-start is given: longer than any step, so that the scheduler starts
# the copy as early as its input allows (the H200 run gave 1-2 s; the position is the same).
HINT_COST_US = 10_000_000
_FINGERPRINT = re.compile(r'fingerprint_before_lhs="([0-9a-f]+)"')


class CopyScheduleHints:
    """The profiles directory of one manager's hinted window variants."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or tempfile.mkdtemp(prefix="overlap-ckpt-copy-schedule-")
        os.makedirs(self.directory, exist_ok=True)

    def compiler_options(self) -> dict[str, str]:
        """What the user's ``jax.jit(..., compiler_options=...)`` takes."""
        return {PGLE_OPTION: self.directory}

    @staticmethod
    def wanted(tickets: WindowTicket | Iterable[WindowTicket]) -> bool:
        """Whether a variant gets a hint: a captured last phase of a GPU plan (every ticket
        of it, where one step runs several managers' windows)."""
        tickets = (tickets,) if isinstance(tickets, WindowTicket) else tuple(tickets)
        return bool(tickets) and all(t.last and t.capture and t.plan.platform == "gpu" for t in tickets)

    def prepare(self, lowered: Any) -> bool:
        """Write the profile of ``lowered`` (a window variant of the user's jitted step) before
        it is compiled for real; True when one was written.

        The side compile names another, empty, profiles directory, so that it is not the
        compile the step's jit caches; its program has the same fingerprint (the option does
        not change the program before scheduling)."""
        from ..aot.hlo import entry_instructions, host_copies  # the aot package, only when hinting

        aside = os.path.join(self.directory, "aside")
        os.makedirs(aside, exist_ok=True)
        text = lowered.compile(compiler_options={PGLE_OPTION: aside}).as_text()
        found = _FINGERPRINT.search(text)
        copies = [c for c in host_copies(entry_instructions(text)) if c.asynchronous]
        if found is None or not copies:  # not XLA:GPU's program, or nothing to hint
            return False
        fingerprint = found.group(1)
        write_profile(os.path.join(self.directory, fingerprint + ".pbtxt"), {c.name: HINT_COST_US for c in copies})
        log.info("copy schedule hint for %d host copies of program %s", len(copies), fingerprint)
        return True


def write_profile(path: str, costs_us: Mapping[str, float]) -> None:
    """A PGLE profile (a text ``ProfiledInstructionsProto``) giving each named instruction
    its cost in microseconds; XLA falls back to its own estimate for the others."""
    with open(path, "w") as f:
        f.writelines(f'costs {{ name: "{name}" cost_us: {us:.1f} }}\n' for name, us in costs_us.items())
