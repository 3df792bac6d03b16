"""Let every process of a multi-process test job write JAX's compilation cache.

Why: JAX writes persistent cache entries from process 0 only, and on the CPU backend a
program's cache key holds the topology as the compiling process sees it (its fingerprint
differs by process index), so processes 1..N-1 never find an entry and compile every
program in every run: in a warm CI run, 3 of a 4-process job's processes compiled 32
programs each, per job. With this, each process writes its entries under its own keys and
a later run reads them. What is read back is what a compile gives (the key holds the
program, the compile options and the topology); only who may write an entry changes.

Called by the multi-process test workers right after ``import jax``. A no-op where the test
run keeps no compilation cache (``JAX_COMPILATION_CACHE_DIR`` unset), or where jax's private
layout is not the one this reads (those processes then compile, as before).
"""

from __future__ import annotations

import functools
import os
import warnings


def cache_compiles_of_every_process() -> None:
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    try:
        from jax._src import compilation_cache, compiler, distributed
    except ImportError:
        return
    write = getattr(compiler, "_cache_write", None)
    if write is None or not hasattr(compilation_cache, "put_executable_and_time"):
        return

    @functools.wraps(write)
    def write_from_any_process(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0 or host_callbacks:
            return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        # What jax's own write does past its process check. No minimum compile time: the
        # tests' cache takes every program (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0).
        try:
            compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                      int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - as jax does: a failed write costs a compile later
            warnings.warn(f"compilation cache entry for {module_name!r} not written: {type(e).__name__}: {e}")

    compiler._cache_write = write_from_any_process
