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
