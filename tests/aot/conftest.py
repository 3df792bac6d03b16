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


# Measured, not yet explained: a TPU window phase of the tiny LMs allocates ~12 MB of device
# temporaries where the plain step needs none (its intermediates stay on chip), also with
# no barrier and for a phase with a 0.4 MB outbox; see docs/aot.md.
TPU_TEMP_REASON = "TPU window phases of a tiny model allocate ~12 MB of temporaries the plain step does not"


def assert_within_plain_plus_outbox(report):
    """Every phase needs at most the plain step's device memory plus its outbox."""
    for program in report.phases:
        within = program.memory.peak <= report.plain.memory.peak + program.memory.host_output
        if not within and report.target.platform == "tpu":
            pytest.xfail(f"{TPU_TEMP_REASON}: {program.name} {program.memory} vs plain {report.plain.memory}")
        assert within, (program.name, program.memory, report.plain.memory)
