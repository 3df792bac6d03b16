"""What ``benchmarks.run`` compares: its configurations, their labels in the report, and the
targets the report checks. The driver, the worker, the analysis and the report all name
configurations by these keys, so they are defined once, here."""

from __future__ import annotations

CONFIGS = ("orbax_sync", "orbax_async", "overlap_idle", "overlap_k1", "overlap_auto", "overlap_k3", "raw_beside",
           "overlap_k1_hint")
LABELS = {"none": "no checkpointing", "orbax_sync": "Orbax sync", "orbax_async": "Orbax async",
          "overlap_idle": "overlap, no window reached", "overlap_k1": "overlap K=1",
          "overlap_auto": "overlap auto-K", "overlap_k3": "overlap K=3",
          "raw_beside": "raw write beside training", "overlap_k1_hint": "overlap K=1, copy hint"}
WINDOWS = {"overlap_idle": 1, "overlap_k1": 1, "overlap_k3": 3, "overlap_auto": "auto", "overlap_k1_hint": 1}
# Configurations whose step is jitted with CheckpointManager.jit_compiler_options() (GPU only:
# the window's host copy scheduled at the top of the step; elsewhere the options are empty).
COPY_HINT = ("overlap_k1_hint",)
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c not in COPY_HINT)  # the hint is for GPU runs
TARGETS = {"plain_step_vs_none": 1.01, "ettr": 0.95, "persist_vs_raw": 0.90, "restore_vs_orbax": 2.0,
           "rss_vs_state": 1.25, "compile_vs_plain": 1.5}
OPTIMIZERS = ("adamw", "clip_adamw")
MODELS = ("tiny", "small", "20m", "100m", "1b")
DEFAULT_BATCH_SIZE = {"tiny": 8, "small": 8, "20m": 4, "100m": 4, "1b": 8}
AFTER_STEPS = 3  # steps after a checkpoint's last step whose extra time the report lists
GIB = 2**30
