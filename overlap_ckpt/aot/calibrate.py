"""The CPU target's numbers, measured: the one backend where the prediction of
:mod:`overlap_ckpt.aot.predict` can be set beside a measured step (tests/aot).

The probes stand in for an accelerator's datasheet, so each measures what the datasheet
figure means: a peak rate is the best the hardware does (the fastest of several tries, not
the median: on a shared machine the median measures the other jobs), the memory bandwidth
is the traffic of a copy between buffers already in use (as HBM's figure counts reads and
writes), and the host link is the copy that Orbax's blocking save makes on this backend
(into fresh host memory). jax's own device-to-host transfer on the CPU
(:func:`overlap_ckpt.costmodel.measure_d2h_bandwidth`) ran at 1.6-2.2 GB/s where numpy
copied the same 64 MiB at 4-8 GB/s, and taken as both figures it predicted the small LM's
step 2.5x too slow and Orbax's stall 6.5x too long.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

MATMUL_SIZE = 2048
PROBE_BYTES = 64 << 20


def _fastest_s(run, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def measure_cpu_flops(repeats: int = 7) -> float:
    """f32 matmul rate of this machine's CPU backend in flop/s (the fastest of ``repeats``):
    the CPU's "peak" for the step-time prediction, as a datasheet gives an accelerator's."""
    x = jnp.ones((MATMUL_SIZE, MATMUL_SIZE), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    return 2 * MATMUL_SIZE**3 / _fastest_s(lambda: matmul(x).block_until_ready(), repeats)


def measure_memory_bytes_per_s(nbytes: int = PROBE_BYTES, repeats: int = 7) -> float:
    """Memory traffic (bytes read + written) per second of a copy between two buffers
    already touched: the CPU's "HBM bandwidth", the rate the step's own traffic can reach."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    return 2 * nbytes / _fastest_s(lambda: np.copyto(dst, src), repeats)


def measure_host_copy_bytes_per_s(nbytes: int = PROBE_BYTES, repeats: int = 7) -> float:
    """Bytes per second of a copy into fresh host memory, the copy :func:`measure_blocking_copy_s`
    times for Orbax: the CPU's "host link" (fastest of ``repeats``)."""
    src = np.ones(nbytes, np.uint8)
    return nbytes / _fastest_s(lambda: np.array(src, copy=True), repeats)


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
