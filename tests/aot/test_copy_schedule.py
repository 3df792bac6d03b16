"""Where XLA:GPU starts a window's host copy (compile-only H100), as
``benchmarks.bench_copy_schedule`` reads it: by default after a good part of the step's
compute, although the copy reads the step's inputs (on an H200 this left 0.15 s of a 0.24 s
step waiting for the 1B LM's copy: benchmarks/results/gpu_h200_1b_copy_schedule.md); with
the latency hint, at the top of the program. Reference: the positions are counted in the
compiled program's own schedule; the plain step must not change with the hint."""

from benchmarks.bench_copy_schedule import host_copy_positions
from overlap_ckpt.tools.aot.lm_step import lm_setup, lower_with, plan_window
from overlap_ckpt.aot.programs import fingerprint
from overlap_ckpt.manager.copy_schedule import CopyScheduleHints
from overlap_ckpt.core.ticket import WindowTicket

from .conftest import target_or_skip


def test_h100_copy_schedule_hints_reach_the_users_jit_through_its_compiler_options(tmp_path):
    """What ``CheckpointManager.jit_compiler_options`` and ``compile_ahead`` do, on the
    compile-only H100: the step's jit names the hints directory, the last phase's profile is
    written before its real compile, which then starts the copy at the top (without the
    hint XLA starts it after about a third of the step's compute: 101 of 322 ops,
    benchmarks/results/aot_h100_100m_copy_schedule.md for the 100M LM); the phases that
    ship gradients are not hinted, and the plain step is the program a jit without the
    option compiles."""
    setup = lm_setup(target_or_skip("h100"), "20m", batch_per_device=4)
    hints = CopyScheduleHints(str(tmp_path / "hints"))
    lower = lower_with(setup, hints.compiler_options())
    last, first = WindowTicket(plan_window(setup, 1), 0), WindowTicket(plan_window(setup, 2), 0)
    assert hints.wanted(last) and not hints.wanted(first)
    lowered = lower(last)
    assert hints.prepare(lowered)
    (copy,) = host_copy_positions(lowered.compile().as_text())
    assert copy["compute_before"] <= 0.02 * copy["compute_total"], copy
    assert fingerprint(lower(None).compile().as_text()) == fingerprint(lower_with(setup)(None).compile().as_text())
