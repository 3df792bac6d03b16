"""The CPU target's run: the compiled step and Orbax's blocking copy, timed here.

The one backend where the prediction of :mod:`overlap_ckpt.aot.predict` can be set beside a
measured step (:mod:`overlap_ckpt.tools.aot.cpu_check`); the CPU's own figures, which stand
in for a datasheet, are probed in :mod:`overlap_ckpt.costmodel.hardware`.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

def measure_step_s(lowered: jax.stages.Lowered, args: tuple, repeats: int = 5) -> float:
    """Median wall time of the compiled step on ``args`` (CPU target: real arrays)."""
    compiled = lowered.compile()
    out = compiled(*zeros_of(args))
    jax.block_until_ready(out)
    seconds = []
    for _ in range(repeats):
        fresh = jax.block_until_ready(zeros_of(args))  # the step donates its state; filled before timing
        start = time.perf_counter()
        jax.block_until_ready(compiled(*fresh))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure_blocking_copy_s(tree, repeats: int = 3) -> float:
    """Median time of a blocking copy of ``tree`` into fresh host buffers: what Orbax's
    async save waits for before training resumes."""
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for leaf in jax.tree.leaves(tree):
            np.array(leaf, copy=True)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def zeros_of(tree):
    """Real zero arrays of an abstract tree's shapes, dtypes and shardings."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), tree)
