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
