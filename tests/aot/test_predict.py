"""The stall predicted from where a compiled schedule starts each host copy
(:func:`overlap_ckpt.aot.predict.scheduled_stall_s`), against hand arithmetic on
programs written out here: a step of 1 s whose time runs with its matmul flops, a host
link of 10 bytes/s."""

import dataclasses
import types

import pytest

from overlap_ckpt.aot import predict
from overlap_ckpt.aot.hlo import HostCopy
from overlap_ckpt.aot.programs import DeviceMemory, ProgramReport

FLOPS = 100.0


def program(*copies: tuple[int, float, float, bool]) -> ProgramReport:
    """Copies as (bytes, matmul flops before the start, flops while it transfers, async)."""
    host = tuple(HostCopy(f"leaf{n}", nbytes, asynchronous, "1", int(between > 0), 0, f"copy-start.{n}",
                          before, between) for n, (nbytes, before, between, asynchronous) in enumerate(copies))
    memory = DeviceMemory(0, 0, 0, 0, sum(c.nbytes for c in host))
    return ProgramReport("phase", memory, host, (), None, None, "0", 0.0, FLOPS)


@pytest.mark.parametrize("copies,stall", [
    ([(10, 0, 100, True)], 0.0),  # started at the top: 1 s of transfer under 1 s of step
    ([(10, 70, 30, True)], 0.7),  # started after 70% of the step: waits 0.7 s at its done
    ([(5, 0, 100, True), (5, 20, 80, True)], 0.0),  # one after the other on the link, both in time
    ([(5, 0, 100, True), (5, 20, 40, True)], 0.4),  # the second waits for the link: ends at 1.0, due at 0.6
    ([(4, 50, 0, False)], 0.4),  # a blocking copy: its whole transfer
    # the first waits 0.5 s at its done, which delays the second's start and done alike; the
    # second then waits for the link (free at 1.5, its transfer ends at 1.7, due at 1.5)
    ([(10, 50, 50, True), (2, 80, 20, True)], 0.7),
])
def test_a_copy_stalls_for_what_of_its_transfer_the_step_after_its_start_cannot_cover(copies, stall):
    assert predict.scheduled_stall_s(program(*copies), 1.0, 10.0) == pytest.approx(stall)


def test_window_auto_reads_the_share_of_the_step_the_compiled_copies_get():
    """Per phase its best-placed copy, then the worst phase; nothing to tell by without matmuls."""
    report = types.SimpleNamespace(phases=(program((10, 0, 100, True)), program((10, 60, 30, True), (1, 10, 5, True))))
    assert predict.schedule_fraction(report) == pytest.approx(0.3)
    no_matmuls = dataclasses.replace(program((10, 0, 0, True)), matmul_flops=0.0)
    no_copies = program()  # the CPU target: the outbox never leaves its one memory
    for phases in [(no_matmuls,), (program((10, 0, 100, True)), no_copies), ()]:
        assert predict.schedule_fraction(types.SimpleNamespace(phases=phases)) is None
