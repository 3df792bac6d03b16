"""What several benchmarks measure or run the same way: this process's RSS (now, at its peak,
and once freed heap pages are given back), the bytes of a tree of arrays, and a measurement
run in a fresh Python process.

Why one module: ``benchmarks.run``'s workers, ``bench_host_memory`` and ``bench_executables``
read RSS the same way, and four scripts start a fresh process per configuration so that its
peak RSS and its compiled programs are its own; each kept a copy of these few lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def _status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` size field (``VmRSS``, ``VmHWM``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_now() -> int:
    """This process's resident set size in bytes (0 where neither /proc nor psutil tells)."""
    rss = _status_bytes("VmRSS")
    if rss is not None:
        return rss
    try:
        import psutil
    except ImportError:
        return 0
    return int(psutil.Process().memory_info().rss)


def rss_peak() -> int:
    """High-water mark of this process's RSS in bytes."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)


def settled_rss() -> int:
    """RSS once garbage is collected and freed heap pages are given back (``malloc_trim``):
    what the process holds, not what glibc keeps in its arenas."""
    import gc

    from overlap_ckpt.core.buffers import trim_host_memory

    gc.collect()
    trim_host_memory()
    return rss_now()


def tree_bytes(tree: Any) -> int:
    """Bytes of every array in ``tree``."""
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def run_fresh(module: str, args: list[str], env: dict | None = None, timeout: float | None = None,
              label: str | None = None) -> Any:
    """``python -m module *args`` in a fresh process: the JSON on its last line of stdout.

    Raises RuntimeError with the end of its stderr when it fails; ``label`` names the
    measurement in that message (default: the arguments).
    """
    proc = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{module} {label or ' '.join(args)} failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1])
