"""Where XLA:GPU starts a window's host copy (compile-only H100), as
``benchmarks.bench_copy_schedule`` reads it: by default after a good part of the step's
compute, although the copy reads the step's inputs (on an H200 this left 0.15 s of a 0.24 s
step waiting for the 1B LM's copy: benchmarks/results/gpu_h200_1b_copy_schedule.md); with
the latency hint, at the top of the program. Reference: the positions are counted in the
compiled program's own schedule; the plain step must not change with the hint."""

from benchmarks.bench_copy_schedule import host_copy_positions, latency_hint
from overlap_ckpt.aot.lm_step import lm_setup, lower_with, plan_window
from overlap_ckpt.aot.programs import fingerprint
from overlap_ckpt.core.capture import WindowTicket

from .conftest import target_or_skip


def test_h100_latency_hint_starts_the_last_phases_copy_at_the_top_of_the_step(tmp_path):
    setup = lm_setup(target_or_skip("h100"), "20m", batch_per_device=4)
    lower = lower_with(setup)
    lowered = lower(WindowTicket(plan_window(setup, 1), 0))
    default = host_copy_positions(lowered.compile().as_text())
    assert len(default) == 1 and default[0]["bytes"] > 0
    options = {"xla_gpu_pgle_profile_file_or_directory_path": latency_hint(default, 52.0, 10.0, str(tmp_path))}
    (hinted,) = host_copy_positions(lowered.compile(compiler_options=options).as_text())
    (copy,) = default
    assert copy["compute_before"] > copy["compute_total"] // 4, copy  # late: what the H200 showed
    assert hinted["start"] == copy["start"] and hinted["compute_before"] <= 0.02 * hinted["compute_total"], hinted
    plain = lower(None)
    assert fingerprint(plain.compile().as_text()) == fingerprint(plain.compile(compiler_options=options).as_text())
