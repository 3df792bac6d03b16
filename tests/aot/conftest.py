"""Compile-only targets for the tests: skipped cleanly where their plugins are absent.

CI installs them (``pip install -e ".[test,aot]"``) and runs with ``JAX_PLATFORMS=cpu``,
under which jax registers the CUDA plugin without a GPU (see docs/aot.md).
"""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from overlap_ckpt.aot import TargetError, get_target


@pytest.fixture(scope="package", autouse=True)
def compile_without_the_cache():
    """The compile-only reports read the compiler's dumps, which a compile answered by the
    run's shared cache (``tests/conftest.py``) does not write; and a compile-only target's
    program cannot be read back from the cache (no client to load it). Package-wide: the
    module fixtures compile too."""
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


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


# The layout allowance the check grants a window phase beyond the plain step plus its
# outbox (overlap_ckpt.aot.window.LAYOUT_ALLOWANCE_BYTES), written here on its own: these
# tests hold the compiled programs to it whatever the library allows. What the test models
# use of it, measured: the tiny Linen TrainState's phase 0 on v5e:2x2, 298 KiB (XLA:TPU's
# 16 KiB per asynchronous operation, and gradients its isolation keeps live); its last
# phase on the H100, 52 KiB (XLA:GPU's layout of temporaries around the packed outbox).
# See docs/aot.md.
LAYOUT_ALLOWANCE = 1 << 20


def assert_within_plain_plus_outbox(report):
    """Every phase needs at most the plain step's device memory plus its outbox, and a
    layout allowance that does not grow with the model; the library's check agrees."""
    for program in report.phases:
        excess = program.memory.peak - report.plain.memory.peak - program.memory.host_output
        assert excess <= LAYOUT_ALLOWANCE, (program.name, excess, program.memory, report.plain.memory)
    report.check()
