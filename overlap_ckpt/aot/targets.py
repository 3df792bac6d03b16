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

from ..costmodel import gpu_specs
from ..costmodel.hardware import TPU_FIGURES, Hardware, h100_hardware, hardware_of, tpu_hardware

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
    if generation in TPU_FIGURES and ":" in name:
        return _tpu_target(name, generation, host_gbps)
    raise TargetError(f"unknown target {name!r}: use cpu, gpu, h100 or a TPU topology "
                      f"<generation>:<shape> with generation in {sorted(TPU_FIGURES)} (e.g. v5e:2x2)")


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
    the prediction can be set beside a measurement (:mod:`overlap_ckpt.tools.aot.device_check`)."""
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
    prediction can be checked against a run (:mod:`overlap_ckpt.costmodel.hardware`)."""
    from ..costmodel.hardware import measure_cpu_flops, measure_host_copy_bytes_per_s, measure_memory_bytes_per_s

    host = host_gbps * GB if host_gbps else measure_host_copy_bytes_per_s()
    memory = measure_memory_bytes_per_s()
    flops = measure_cpu_flops()
    return Target("cpu", "cpu", tuple(jax.devices("cpu")), memory, host, flops, float("inf"),
                  f"this CPU, measured (fastest of 7): f32 matmul {flops / 1e9:.1f} GFLOP/s, memory traffic "
                  f"of a warm copy {memory / GB:.1f} GB/s (the HBM figure), a copy into fresh host memory "
                  f"{host / GB:.1f} GB/s (the host link: Orbax's blocking copy on this backend)", local=True)
