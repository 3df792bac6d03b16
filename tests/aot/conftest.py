"""Compile-only targets for the tests: skipped cleanly where their plugins are absent.

CI installs them (``pip install -e ".[test,aot]"``) and runs with ``JAX_PLATFORMS=cpu``,
under which jax registers the CUDA plugin without a GPU (see docs/aot.md).
"""

import pytest

from overlap_ckpt.aot import TargetError, get_target

TPU_TARGET = "v5e:2x2"


def target_or_skip(name: str):
    if name == "h100":
        pytest.importorskip("jax_plugins.xla_cuda12", reason="the CUDA plugin is not installed (extra 'aot')")
    else:
        pytest.importorskip("libtpu", reason="libtpu is not installed (extra 'aot')")
    try:
        return get_target(name)
    except TargetError as e:
        pytest.skip(str(e))


# Measured and explained, not fixed: XLA:TPU reserves a 512-byte slot at a 16 KiB stride
# of device memory for every asynchronous operation (host copies and the compiler's own
# prefetches into VMEM); a tiny LM's temporaries are nothing else. The tiny Linen
# TrainState's phase 0 adds 2 host copies and 16 prefetches of 80-byte bias blocks that the
# packing reads before the update overwrites them: +288 KiB for a 396 KiB outbox, 315 KB
# beyond plain + outbox. See docs/aot.md ("Device memory on TPU").
TPU_SLOT_REASON = "the tiny LM's phase reserves 16 KiB of TPU device memory per added asynchronous operation"
TPU_SLOT_SLACK = 512 << 10


# Measured, not yet fixed: a packed outbox (overlap_ckpt/core/packing.py) is a device buffer
# while its host copy runs; in the last phase of the tiny Linen LM the copy spans the whole
# step and XLA:GPU's buffer assignment needs 54 KB (4% of the 1.2 MB outbox) beyond plain +
# outbox around it. The 1B LM's phases stay 0.1-0.2 GiB under; see docs/aot.md.
GPU_PACK_REASON = "the tiny LM's packed last phase needs up to 64 KiB beyond plain + outbox on the H100"
GPU_PACK_SLACK = 64 << 10


def assert_within_plain_plus_outbox(report):
    """Every phase needs at most the plain step's device memory plus its outbox."""
    for program in report.phases:
        excess = program.memory.peak - report.plain.memory.peak - program.memory.host_output
        if 0 < excess <= TPU_SLOT_SLACK and report.target.platform == "tpu":
            pytest.xfail(f"{TPU_SLOT_REASON}: {program.name} {program.memory} vs plain {report.plain.memory}")
        if 0 < excess <= GPU_PACK_SLACK and report.target.platform == "gpu":
            pytest.xfail(f"{GPU_PACK_REASON}: {program.name} {program.memory} vs plain {report.plain.memory}")
        assert excess <= 0, (program.name, program.memory, report.plain.memory)
