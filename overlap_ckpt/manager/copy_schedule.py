"""Opt-in on GPUs: start every window copy at the top of the step, at no device memory.

Why: XLA:GPU's latency-hiding scheduler models every host copy at the same small cost
whatever its bytes (5,000 of its units) and keeps at most one asynchronous copy in flight
beside compute. By default it therefore starts a window's copy where that cost runs out
before its last reader, after 0.57-0.72 of the step's compute (0.32 of the 1B LM's step
left after it, compile-only H100); per-leaf copies, which need no device memory, would
serialize, so a GPU plan packs its outbox into one copy per element width, and a packed
copy holds its bytes on the device while in flight. On an H200 the 1B LM's K=1 window cost
0.15-0.17 s of a 0.24 s step that way (benchmarks/results/gpu_h200_1b_copy_schedule.md).

What the hint does: the window plans copy leaf by leaf (no packing:
:meth:`overlap_ckpt.core.engine.OverlapEngine.copy_per_leaf`), each copy reading a buffer
the step holds anyway; a profile-guided latency profile (PGLE) gives every host
``copy-start`` of every capturing phase a cost longer than any step (:data:`HINT_COST_US`;
a copy of the state more than all the phase's other copies together, :func:`state_cost_us`,
told apart by the outbox output it lands in: :mod:`overlap_ckpt.aot.outbox`), so the
scheduler starts each one as early as its input allows; and
``xla_gpu_experimental_parallel_async_compute_limit`` (:data:`PARALLEL_LIMIT`) lets that
many copies be in flight beside compute. Compile-only H100, jax 0.10.2: the 1B LM's K=1
phase starts all 877 copies before any matmul, none serialized, for +1.4 MiB of device
memory at batch 16 (+0.4 MiB at batch 4), where the packed hint cost +9.6 GiB and the
default +1.2 GiB; its K=3 phases start every state copy at the top too, for +1-30 MiB
(benchmarks/results/aot_h100_1b_hinted.md). Gradient copies still start after the backward
pass, where the gradients exist.

How the hint reaches the user's program: both are XLA ``DebugOptions`` that a
``jax.jit(..., compiler_options=...)`` takes for the programs it compiles
(:meth:`CopyScheduleHints.compiler_options`). XLA reads PGLE profiles from the directory
``xla_gpu_pgle_profile_file_or_directory_path`` names, one file per program, named by the
program's fingerprint before scheduling; ``compile_ahead`` compiles each capturing variant
once on the side to learn its fingerprint and copies, writes the profile, then compiles it
for real (:meth:`CopyScheduleHints.prepare`). A program without a profile there (the plain
step, a skipped window's variant) compiles as it would without the PGLE option.

What it costs, why it stays opt-in: the options reach the user's program only through the
user's own ``jax.jit``; every capturing variant compiles twice (in the background); XLA
logs an error line when a program has no profile and a warning for every instruction a
profile does not name; and the parallel limit applies to every program of that jit,
the plain step included (the compile-only H100 LM steps, which have no other asynchronous
work, compile to the same plain program). What it does not do: make the link faster (a
copy still takes its bytes over the host link; at K=1 the 1B LM's 10.9 GiB take longer than
its step), or start a gradient copy before the backward pass.
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
# How many asynchronous operations XLA:GPU's scheduler may keep in flight beside compute
# (default 1: host copies then serialize). Read per compile from the jit's compiler_options.
PARALLEL_LIMIT_OPTION = "xla_gpu_experimental_parallel_async_compute_limit"
PARALLEL_LIMIT = 1000  # more than the host copies of any phase measured (877: the 1B LM's K=1)
# The cost each hinted copy-start is given: longer than any step, so that the scheduler starts
# the copy as early as its input allows (the H200 run gave 1-2 s; the position is the same).
HINT_COST_US = 10_000_000
# A copy of the step's input state gets more than all the others together (state_cost_us):
# XLA's scheduler works from the end of the program back, and where nothing else is ready it
# moves its clock on to the next copy's start; each gradient copy (whose input comes late)
# can move it by its whole cost, after which a state copy of no more than the sum counts as
# covered and starts wherever it lands. Compile-only H100: one cost for both started the tiny
# NNX LM's phase 0 of 2 state copies at 0.19-0.90 of the step's matmuls after them; 100x the
# gradient copies' cost, the 1B LM's K=3 phases (104 and 173 gradient copies) at 0.43-1.00
# and 0.57-1.00; more than their sum, every one at the top.
_FINGERPRINT = re.compile(r'fingerprint_before_lhs="([0-9a-f]+)"')


class CopyScheduleHints:
    """The profiles directory of one manager's hinted window variants."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or tempfile.mkdtemp(prefix="overlap-ckpt-copy-schedule-")
        os.makedirs(self.directory, exist_ok=True)

    def compiler_options(self) -> dict[str, str]:
        """What the user's ``jax.jit(..., compiler_options=...)`` takes."""
        return {PGLE_OPTION: self.directory, PARALLEL_LIMIT_OPTION: str(PARALLEL_LIMIT)}

    @staticmethod
    def wanted(tickets: WindowTicket | Iterable[WindowTicket]) -> bool:
        """Whether a variant gets a hint: any phase of a GPU plan that captures (one
        ticket of it at least, where one step runs several managers' windows)."""
        tickets = (tickets,) if isinstance(tickets, WindowTicket) else tuple(tickets)
        return any(t.capture and t.plan.platform == "gpu" for t in tickets)

    def prepare(self, lowered: Any) -> bool:
        """Write the profile of ``lowered`` (a window variant of the user's jitted step) before
        it is compiled for real; True when one was written.

        The side compile names another, empty, profiles directory, so that it is not the
        compile the step's jit caches; its program has the same fingerprint (the option does
        not change the program before scheduling)."""
        from ..aot.hlo import entry_instructions, host_copies  # the aot package, only when hinting
        from ..aot.outbox import STATE
        from ..aot.programs import outputs_of

        aside = os.path.join(self.directory, "aside")
        os.makedirs(aside, exist_ok=True)
        text = lowered.compile(compiler_options={PGLE_OPTION: aside}).as_text()
        found = _FINGERPRINT.search(text)
        instructions = entry_instructions(text)
        copies = [c for c in host_copies(instructions, outputs=outputs_of(lowered, instructions)) if c.asynchronous]
        if found is None or not copies:  # not XLA:GPU's program, or nothing to hint
            return False
        fingerprint = found.group(1)
        state = state_cost_us(sum(c.kind != STATE for c in copies))
        write_profile(os.path.join(self.directory, fingerprint + ".pbtxt"),
                      {c.name: state if c.kind == STATE else HINT_COST_US for c in copies})
        log.info("copy schedule hint for %d host copies of program %s", len(copies), fingerprint)
        return True


def state_cost_us(others: int) -> float:
    """The cost of a state copy in a program whose ``others`` copies (gradients, scalars)
    cost :data:`HINT_COST_US` each: more than all of them and the step together."""
    return HINT_COST_US * (others + 2)


def write_profile(path: str, costs_us: Mapping[str, float]) -> None:
    """A PGLE profile (a text ``ProfiledInstructionsProto``) giving each named instruction
    its cost in microseconds; XLA falls back to its own estimate for the others."""
    with open(path, "w") as f:
        f.writelines(f'costs {{ name: "{name}" cost_us: {us:.1f} }}\n' for name, us in costs_us.items())
