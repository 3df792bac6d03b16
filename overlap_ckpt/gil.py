"""Our host worker gives the GIL to the training thread between leaves.

Why: every step, the training thread frees the arrays of the state it donated, one at a
time, and jaxlib releases the GIL around freeing each one. If a thread of ours is running
Python at that moment, CPython hands the GIL back to the training thread only when its
switch interval (5 ms) runs out, once per freed array. On an H200 (100M LM, 591 state
arrays) the training thread took 121 ms (K=1) and 242 ms (K=3) to issue the step after a
window, while the host worker handed the window to storage, and the device waited
(``benchmarks/results/gpu_h200_100m_profile.md``). So the loops over leaves that run on our
host worker give up the GIL after each leaf (``time.sleep(0)``): a training thread waiting
for it takes it, and frees many arrays while the worker's sleep call returns. The call costs
the worker 80-90 us on this project's VMs (a timer syscall): a few tenths of a second of its
time per window of 600 leaves, none of the training thread's. Yielding only once 0.2 ms had
passed did no better in ``benchmarks.bench_dispatch``, and ``os.sched_yield`` (1 us) handed
the GIL over less reliably in our probes. The writer thread does not yield: its yields
slowed the persist (155 -> 340 ms on 600 leaves) and did not shorten the training thread's
steps.

Only threads marked with :func:`background` yield: on the training thread (a user's
``save()`` prepares its tree there) a yield would hand the GIL to our threads instead.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_thread = threading.local()
_give_up_gil = functools.partial(time.sleep, 0)  # releases the GIL, and takes it back


def background(target: Callable[..., R]) -> Callable[..., R]:
    """``target`` (a thread's run function), with :func:`yielding` giving up the GIL on its
    thread."""

    @functools.wraps(target)
    def run(*args, **kwargs) -> R:
        _thread.yields = True
        return target(*args, **kwargs)

    return run


def yielding(items: Iterable[T]) -> Iterator[T]:
    """``items``; on a :func:`background` thread, the GIL is given up after each one."""
    if not getattr(_thread, "yields", False):
        yield from items
        return
    for item in items:
        yield item
        _give_up_gil()
