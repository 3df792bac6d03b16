"""The H100 as XLA's GPU compiler sees it, for compiling without the GPU, and the H200's
numbers for running on one.

The values are those of XLA's own description of an H100 SXM
(``xla/backends/gpu/target_config/specs/h100_sxm.txtpb`` in openxla/xla), trimmed to the
``GpuTargetConfigProto`` fields that jaxlib 0.10 knows (the per-unit rate tables and a few
newer fields are refused by its text-format parser). The numbers the cost model needs
(bandwidths, peak rate) are kept beside it so that they come from the same source.
"""

from __future__ import annotations

H100_SXM_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
    feature_extension: ACCELERATED_FEATURES
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info {
  major: 8
  minor: 9
  patch: 4
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# From the same spec file: memory_bandwidth, device_memory_size, pcie_bandwidth.
H100_HBM_BYTES_PER_S = 3_352_320_000_000
H100_DEVICE_MEMORY_BYTES = 84_942_979_072
H100_PCIE_BYTES_PER_S = 34_359_738_368
# bf16 tensor-core rate of the spec's matrix_unit_description (key 16 = BF16): clock
# 1.8295201 GHz x 4 units per core x 512 ops per clock x 132 cores, 2 flops per op.
H100_BF16_FLOPS = 1.8295201e9 * 4 * 512 * 132 * 2

# The H200 (SXM) is the H100's chip with more and faster memory; XLA has no description of
# it to compile for, so these figures serve predictions on a real H200 only. HBM bandwidth
# and size from NVIDIA's H200 datasheet (4.8 TB/s, 141 GB); the bf16 rate is the H100's
# (same chip and clocks) and the host link the H100 spec's (both PCIe Gen5 x16): assumptions.
H200_HBM_BYTES_PER_S = 4_800_000_000_000
H200_DEVICE_MEMORY_BYTES = 141_000_000_000
