"""The numbers of the hardware a checkpoint runs on: datasheet figures and their measurement.

Why one home: the window size K is chosen from three figures of the device (its peak
rate, its HBM bandwidth, its link to the host), and they come either from a datasheet
(a known accelerator, before any step has run: ``window="auto"`` and ``overlap-ckpt aot``)
or from a probe on the machine itself (the link a running job copies over; the CPU
target, which has no datasheet). Both kinds used to live apart and drifted.

A probe measures what the datasheet figure means: a peak rate is the best the hardware
does (the fastest of several tries, not the median: on a shared machine the median
measures the other jobs), a memory bandwidth is the traffic of a copy between buffers
already in use (HBM's figure counts reads and writes), and the CPU's host link is the copy
Orbax's blocking save makes there (into fresh host memory). jax's own device-to-host
transfer on the CPU (:func:`measure_d2h_bandwidth`) ran at 1.6-2.2 GB/s where numpy copied
the same 64 MiB at 4-8 GB/s, and taken as both figures it predicted the small LM's step
2.5x too slow and Orbax's stall 6.5x too long.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import gpu_specs
from .model import GB, check_int

# Published per-chip figures (Google Cloud TPU system architecture pages): bf16 peak,
# HBM bandwidth and size. The host link of a TPU chip is not published; the value is an
# assumption (PCIe Gen4 x16, ~25 GB/s effective per chip), override it with host_gbps=.
TPU_FIGURES = {
    "v4": (275e12, 1228 * GB, 32 * 2**30),
    "v5e": (197e12, 819 * GB, 16 * 2**30),
    "v5p": (459e12, 2765 * GB, 95 * 2**30),
    "v6e": (918e12, 1640 * GB, 32 * 2**30),
}
TPU_HOST_LINK_BYTES_PER_S = 25 * GB


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The per-device numbers of an accelerator that the stall prediction needs."""

    peak_flops: float  # dense bf16
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float  # device -> host
    device_memory_bytes: float
    sources: str  # where the numbers come from, for reports


def tpu_hardware(generation: str, host_gbps: float | None = None) -> Hardware:
    flops, hbm, memory = TPU_FIGURES[generation]
    host = host_gbps * GB if host_gbps else TPU_HOST_LINK_BYTES_PER_S
    return Hardware(flops, hbm, host, memory,
                    f"TPU {generation}: bf16 peak {flops / 1e12:.0f} TFLOP/s, HBM {hbm / GB:.0f} GB/s "
                    f"(Cloud TPU docs); host link {host / GB:.0f} GB/s per chip "
                    f"({'given' if host_gbps else 'assumed: unpublished, PCIe Gen4 x16'})")


def _gpu_hardware(hbm_bytes_per_s: float, memory_bytes: float, described: str, host_gbps: float | None,
                  link_note: str = "") -> Hardware:
    """A Hopper GPU: the H100's bf16 rate, and XLA's H100 PCIe figure unless ``host_gbps``."""
    host = host_gbps * GB if host_gbps else gpu_specs.H100_PCIE_BYTES_PER_S
    where = "given" if host_gbps else "pcie_bandwidth of the spec" + link_note
    return Hardware(gpu_specs.H100_BF16_FLOPS, hbm_bytes_per_s, host, memory_bytes,
                    f"{described}, bf16 peak {gpu_specs.H100_BF16_FLOPS / 1e12:.0f} TFLOP/s; host link "
                    f"{host / GB:.1f} GB/s ({where})")


def h200_hardware(host_gbps: float | None = None) -> Hardware:
    return _gpu_hardware(gpu_specs.H200_HBM_BYTES_PER_S, gpu_specs.H200_DEVICE_MEMORY_BYTES,
                         f"H200 SXM (the H100's chip): HBM {gpu_specs.H200_HBM_BYTES_PER_S / GB:.0f} GB/s (NVIDIA "
                         "datasheet)", host_gbps, " of XLA's H100: both PCIe Gen5 x16")


def h100_hardware(host_gbps: float | None = None) -> Hardware:
    return _gpu_hardware(gpu_specs.H100_HBM_BYTES_PER_S, gpu_specs.H100_DEVICE_MEMORY_BYTES,
                         f"H100 SXM from XLA's h100_sxm.txtpb: HBM {gpu_specs.H100_HBM_BYTES_PER_S / GB:.0f} GB/s",
                         host_gbps)


# jax's device_kind of each TPU generation (compile-only topologies report the same).
_TPU_KINDS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5": "v5p", "tpu v5p": "v5p",
              "tpu v6 lite": "v6e", "tpu v6e": "v6e"}


def hardware_of(device: Any, host_gbps: float | None = None) -> Hardware | None:
    """The numbers of a real (or compile-only) device from its ``device_kind``; None for a
    kind this module has no figures for (``window="auto"`` then measures instead)."""
    kind = str(getattr(device, "device_kind", "")).strip().lower()
    if kind in _TPU_KINDS:
        return tpu_hardware(_TPU_KINDS[kind], host_gbps)
    if "h100" in kind:
        return h100_hardware(host_gbps)
    if "h200" in kind:
        return h200_hardware(host_gbps)
    return None


# --------------------------------------------------------------------------- probes

MATMUL_SIZE = 2048
PROBE_BYTES = 64 << 20


def fastest_s(run, repeats: int) -> float:
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
    return 2 * MATMUL_SIZE**3 / fastest_s(lambda: matmul(x).block_until_ready(), repeats)


def measure_memory_bytes_per_s(nbytes: int = PROBE_BYTES, repeats: int = 7) -> float:
    """Memory traffic (bytes read + written) per second of a copy between two buffers
    already touched: the CPU's "HBM bandwidth", the rate the step's own traffic can reach."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    return 2 * nbytes / fastest_s(lambda: np.copyto(dst, src), repeats)


def measure_host_copy_bytes_per_s(nbytes: int = PROBE_BYTES, repeats: int = 7) -> float:
    """Bytes per second of a copy into fresh host memory, the copy :func:`measure_blocking_copy_s`
    times for Orbax: the CPU's "host link" (fastest of ``repeats``)."""
    src = np.ones(nbytes, np.uint8)
    return nbytes / fastest_s(lambda: np.array(src, copy=True), repeats)


def measure_d2h_bandwidth(device: Any = None, nbytes: int = 64 << 20,
                          repeats: int = 3) -> float:
    """Measured device->host copy bandwidth in bytes per second (median of ``repeats``).

    Method: a fresh ``nbytes`` uint8 buffer is placed on ``device`` (untimed), then the
    timed part copies it to host memory and waits for completion:

    * if the device exposes a ``pinned_host`` memory kind, by ``jax.device_put`` onto a
      ``SingleDeviceSharding(device, memory_kind="pinned_host")`` -- the same kind of
      copy the overlapped capture issues, so this is the number to feed the model;
    * otherwise with ``jax.device_get``, forcing an explicit copy if the result turns
      out to alias the device buffer (the CPU backend hands out zero-copy views).

    One untimed warm-up copy absorbs compilation and allocator first-touch costs.
    On the CPU backend "device" and "host" are the same RAM, so this measures a memcpy;
    there the copy also competes with compute for the same cores and memory bus, so
    use an ``overlappable_fraction`` near 0 when planning for CPU runs. Small
    ``nbytes`` are dominated by dispatch latency and understate the bandwidth.
    """
    from jax.sharding import SingleDeviceSharding

    nbytes = check_int("nbytes", nbytes)
    repeats = check_int("repeats", repeats)
    if device is None:
        device = jax.local_devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # older runtimes / plugins without memory-kind support
        kinds = set()
    host_sharding = (SingleDeviceSharding(device, memory_kind="pinned_host")
                     if "pinned_host" in kinds else None)
    source = np.ones(nbytes, dtype=np.uint8)

    def fresh() -> Any:
        x = jax.device_put(source, device)
        x.block_until_ready()
        return x

    def copy(x: Any) -> None:
        if host_sharding is not None:
            jax.device_put(x, host_sharding).block_until_ready()
            return
        h = np.asarray(jax.device_get(x))
        try:
            aliased = h.ctypes.data == x.unsafe_buffer_pointer()
        except Exception:
            aliased = False
        if aliased:
            h.copy()

    copy(fresh())  # warm-up
    seconds = []
    for _ in range(repeats):
        x = fresh()
        t0 = time.perf_counter()
        copy(x)
        seconds.append(time.perf_counter() - t0)
        del x
    elapsed = max(statistics.median(seconds), 1e-9)
    return nbytes / elapsed
