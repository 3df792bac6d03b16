"""Compile-only targets: the devices XLA compiles for, and the numbers the cost model uses.

Why compile-only: the library's point is the accelerator path, and a CPU machine can
compile for a TPU slice (libtpu) or an H100 (the CUDA PJRT plugin) with
``jax.experimental.topologies`` and read what the hardware would run. A :class:`Target`
holds those devices and the bandwidths and peak rate the stall prediction needs, with
where each number comes from (printed in every report).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from . import gpu_specs

GB = 1e9
INSTALL_HINT = 'pip install "overlap_ckpt[aot]"'


class TargetError(RuntimeError):
    """A target cannot be built here (an unknown name, a missing plugin)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices to compile for and the per-device numbers of the hardware they stand for."""

    name: str
    platform: str  # "cpu", "gpu", "tpu"
    devices: tuple[Any, ...]
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float  # device -> host, per device
    peak_flops: float  # dense bf16 (f32 on the CPU), per device
    device_memory_bytes: float
    sources: str  # where the numbers come from, for reports
    local: bool = False  # the devices are this machine's: the programs can also run

    def mesh(self, axis: str = "fsdp") -> jax.sharding.Mesh:
        """All the target's devices on one axis (the FSDP layout the reports use)."""
        return jax.sharding.Mesh(np.array(self.devices), (axis,))


# Published per-chip figures (Google Cloud TPU system architecture pages): bf16 peak,
# HBM bandwidth and size. The host link of a TPU chip is not published; the value is an
# assumption (PCIe Gen4 x16, ~25 GB/s effective per chip), override it with host_gbps=.
_TPU = {
    "v4": (275e12, 1228 * GB, 32 * 2**30),
    "v5e": (197e12, 819 * GB, 16 * 2**30),
    "v5p": (459e12, 2765 * GB, 95 * 2**30),
    "v6e": (918e12, 1640 * GB, 32 * 2**30),
}
TPU_HOST_LINK_BYTES_PER_S = 25 * GB


def get_target(name: str, *, host_gbps: float | None = None) -> Target:
    """``"cpu"``, ``"h100"``, a TPU topology such as ``"v5e:2x2"`` / ``"v6e:2x4"``, or
    ``"gpu"``: this machine's own GPUs, where the programs can also run (``--measure``)."""
    if name == "cpu":
        return _cpu_target(host_gbps)
    if name == "h100":
        return _h100_target(host_gbps)
    if name == "gpu":
        return _local_gpu_target(host_gbps)
    generation = name.split(":")[0]
    if generation in _TPU and ":" in name:
        return _tpu_target(name, generation, host_gbps)
    raise TargetError(f"unknown target {name!r}: use cpu, gpu, h100 or a TPU topology "
                      f"<generation>:<shape> with generation in {sorted(_TPU)} (e.g. v5e:2x2)")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The per-device numbers of an accelerator that the stall prediction needs."""

    peak_flops: float  # dense bf16
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float  # device -> host
    device_memory_bytes: float
    sources: str  # where the numbers come from, for reports


def tpu_hardware(generation: str, host_gbps: float | None = None) -> Hardware:
    flops, hbm, memory = _TPU[generation]
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


def _tpu_target(name: str, generation: str, host_gbps: float | None) -> Target:
    from jax.experimental import topologies

    try:
        import libtpu  # noqa: F401 - only to say what is missing
    except ImportError:
        raise TargetError(f"target {name!r} needs libtpu to compile for TPUs: {INSTALL_HINT}") from None
    # Compiling takes no chip; other jax processes on this machine may hold libtpu's lock.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topology = topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # noqa: BLE001 - libtpu's errors name the bad topology
        raise TargetError(f"libtpu cannot describe TPU topology {name!r}: {e}") from e
    return _target(name, "tpu", topology.devices, tpu_hardware(generation, host_gbps))


def _target(name: str, platform: str, devices: Any, hw: Hardware, local: bool = False) -> Target:
    return Target(name, platform, tuple(devices), hw.hbm_bytes_per_s, hw.host_link_bytes_per_s, hw.peak_flops,
                  hw.device_memory_bytes, hw.sources, local)


def _h100_target(host_gbps: float | None) -> Target:
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(topology_name="", platform="cuda", topology="1x1x1",
                                                target_config=gpu_specs.H100_SXM_TARGET_CONFIG)
    except NotImplementedError:
        raise TargetError(
            "target 'h100' needs jax's CUDA plugin registered without a GPU: install it with "
            f"{INSTALL_HINT} and start Python with JAX_PLATFORMS=cpu (the plugin then skips its "
            "CUDA runtime check; compiling needs no GPU)") from None
    return _target("h100", "gpu", topology.devices, h100_hardware(host_gbps))


def _local_gpu_target(host_gbps: float | None) -> Target:
    """This machine's GPUs: the programs compile for the real device and can run on it, so
    the prediction can be set beside a measurement (:mod:`overlap_ckpt.aot.device_check`)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        raise TargetError("target 'gpu' runs on this machine's GPU and JAX sees none here "
                          f"(backends: {jax.default_backend()}); to compile for an H100 without one, "
                          "use --target h100")
    hardware = hardware_of(devices[0], host_gbps)
    if hardware is None:
        raise TargetError(f"target 'gpu': no figures for a {devices[0].device_kind!r} (known: H100, H200); "
                          "the prediction needs its peak rate and bandwidths")
    return _target(f"gpu ({devices[0].device_kind})", "gpu", devices, hardware, local=True)


def _cpu_target(host_gbps: float | None) -> Target:
    """This machine's CPU devices, with measured numbers: the one target where the
    prediction can be checked against a run (:mod:`overlap_ckpt.aot.calibrate`)."""
    from .calibrate import measure_cpu_flops, measure_host_copy_bytes_per_s, measure_memory_bytes_per_s

    host = host_gbps * GB if host_gbps else measure_host_copy_bytes_per_s()
    memory = measure_memory_bytes_per_s()
    flops = measure_cpu_flops()
    return Target("cpu", "cpu", tuple(jax.devices("cpu")), memory, host, flops, float("inf"),
                  f"this CPU, measured (fastest of 7): f32 matmul {flops / 1e9:.1f} GFLOP/s, memory traffic "
                  f"of a warm copy {memory / GB:.1f} GB/s (the HBM figure), a copy into fresh host memory "
                  f"{host / GB:.1f} GB/s (the host link: Orbax's blocking copy on this backend)", local=True)
