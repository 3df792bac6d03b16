"""Test-only switches: run the accelerator code paths of overlap_ckpt on the CPU backend.

Not a user option. CI has no GPU, yet several branches run only on accelerators: the
update isolated by an ``optimization_barrier`` (instead of the CPU's conditional),
``window="auto"`` choosing K with the cost model from the step's program on a known device
or from measurements (instead of K=1), window copies in another memory kind than the
default one.
:func:`emulate_accelerator` makes those branches run here, with the machine-dependent
measurements replaced by the given numbers::

    with overlap_ckpt.testing.emulate_accelerator(step_time_s=0.2, d2h_bytes_per_s=1e9):
        ...  # plans made now isolate with a barrier; window="auto" sees these numbers

What stays different from a real accelerator: XLA:CPU removes optimization barriers
before fusion, so under emulation the backward pass may fuse into the update and the host
replay is no longer bitwise (it is within a few ulp, as on a GPU, where the host and the
device round differently anyway); and the CPU's "pinned_host" memory is host memory, so
nothing is really overlapped.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

from .core import backend
from .costmodel.window import CompiledSchedule
from .manager import window_choice


@contextlib.contextmanager
def emulate_accelerator(platform: str = "gpu", *, step_time_s: float = 0.1,
                        d2h_bytes_per_s: float = 25e9, outbox_memory: str = "pinned_host",
                        hardware: Any = None, hide_fraction: float | None = None,
                        overlapped_bytes: float | None = None) -> Iterator[None]:
    """Within the block, devices follow ``platform``'s rules.

    ``step_time_s`` and ``d2h_bytes_per_s`` are what ``window="auto"`` measures;
    ``outbox_memory`` is the memory kind window steps copy into; ``hardware`` (an
    :class:`overlap_ckpt.costmodel.hardware.Hardware`) the numbers of the device it predicts
    from (None: an unknown device, so ``window="auto"`` measures); ``hide_fraction`` what it
    reads from each window phase ``compile_ahead`` compiles (XLA:CPU's programs have no
    copy to another memory to read it from; None: the cost model's constant) and
    ``overlapped_bytes`` the bytes of its copies that phase's schedule overlapped where it
    serialized the rest (None: it serialized none).
    """
    auto = window_choice
    saved = (backend.emulated, backend.emulated_memory, auto.clock, auto.measure_bandwidth, auto.hardware_of,
             auto.schedule_of)
    ticks = itertools.count()
    backend.emulated = platform
    # Every reading advances by the time of the steps AutoWindow measures between two readings.
    auto.clock = lambda: next(ticks) * step_time_s * auto.MEASURE_STEPS
    auto.measure_bandwidth = lambda device: d2h_bytes_per_s
    backend.emulated_memory = outbox_memory
    auto.hardware_of = lambda device: hardware
    auto.schedule_of = lambda compiled: CompiledSchedule(hide_fraction, overlapped_bytes)
    try:
        yield
    finally:
        (backend.emulated, backend.emulated_memory, auto.clock, auto.measure_bandwidth, auto.hardware_of,
         auto.schedule_of) = saved
