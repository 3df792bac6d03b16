"""The CPU target's numbers, measured: the one backend where the prediction of
:mod:`overlap_ckpt.aot.predict` can be set beside a measured step (tests/aot)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

MATMUL_SIZE = 1024


def measure_cpu_flops(repeats: int = 5) -> float:
    """f32 matmul rate of this machine's CPU backend in flop/s (median of ``repeats``):
    the CPU's "peak" for the step-time prediction, as a datasheet gives an accelerator's."""
    x = jnp.ones((MATMUL_SIZE, MATMUL_SIZE), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return 2 * MATMUL_SIZE**3 / statistics.median(seconds)


def measure_step_s(lowered: jax.stages.Lowered, args: tuple, repeats: int = 5) -> float:
    """Median wall time of the compiled step on ``args`` (CPU target: real arrays)."""
    compiled = lowered.compile()
    out = compiled(*zeros_of(args))
    jax.block_until_ready(out)
    seconds = []
    for _ in range(repeats):
        fresh = zeros_of(args)  # the step donates its state
        start = time.perf_counter()
        jax.block_until_ready(compiled(*fresh))
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure_blocking_copy_s(tree, repeats: int = 3) -> float:
    """Median time of a blocking copy of ``tree`` into fresh host buffers: what Orbax's
    async save waits for before training resumes."""
    import numpy as np

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
