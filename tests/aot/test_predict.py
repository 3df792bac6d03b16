"""The stall predicted from where a compiled schedule starts each host copy
(:func:`overlap_ckpt.aot.predict.scheduled_stall_s`), against hand arithmetic on
programs written out here: a step of 1 s whose time runs with its matmul flops, a host
link of 10 bytes/s."""

import dataclasses
import types

import pytest

from overlap_ckpt import costmodel
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


@pytest.mark.parametrize("copies,fraction", [
    ([(10, 0, 100, True)], 1.0),
    ([(10, 60, 30, True), (1, 10, 5, True)], 0.35),  # apart: both spans count
    ([(10, 10, 50, True), (1, 40, 40, True)], 0.7),  # overlapping: 10..60 and 40..80
    ([(10, 10, 20, True), (1, 12, 5, True)], 0.2),  # one within the other
    ([(10, 0, 0, False), (2, 20, 30, True)], 0.3),  # a blocking copy hides under nothing
])
def test_a_phase_hides_under_the_share_of_the_step_some_copy_is_in_flight(copies, fraction):
    """The copies share one link: the step's flops scheduled while any of them transfers
    (XLA:TPU runs a few at a time, one after another across the step)."""
    assert predict.hide_fraction(program(*copies).host_copies, FLOPS) == pytest.approx(fraction)


def test_window_auto_reads_the_share_of_the_step_the_compiled_copies_get():
    """Per phase the share some copy is in flight, then the worst phase; nothing to tell by
    without matmuls."""
    report = types.SimpleNamespace(phases=(program((10, 0, 100, True)), program((10, 60, 30, True), (1, 10, 5, True))))
    assert predict.schedule_fraction(report) == pytest.approx(0.35)
    no_matmuls = dataclasses.replace(program((10, 0, 0, True)), matmul_flops=0.0)
    no_copies = program()  # the CPU target: the outbox never leaves its one memory
    for phases in [(no_matmuls,), (program((10, 0, 100, True)), no_copies), ()]:
        assert predict.schedule_fraction(types.SimpleNamespace(phases=phases)) is None


MIB = 2**20


@pytest.mark.parametrize("copies,want", [
    ([(3 * MIB, 0, 100, True), (2 * MIB, 0, 0, True)], 3 * MIB),  # a 2 MiB copy with nothing computing
    ([(3 * MIB, 0, 100, True), (MIB, 0, 0, True), (MIB, 0, 0, False)], 3 * MIB),  # 2 MiB serialized in all
    ([(3 * MIB, 0, 100, True), (MIB, 0, 0, True)], None),  # a small copy's worth: not worth a longer window
    ([(3 * MIB, 0, 100, True)], None),
])
def test_a_phase_caps_what_a_step_hides_at_what_it_overlapped_only_where_it_serialized_more_than_a_small_copy(
        copies, want):
    assert predict.overlapped_bytes(program(*copies).host_copies) == want
    report = types.SimpleNamespace(phases=(program(*copies), program((8 * MIB, 0, 100, True))))
    assert predict.schedule_capacity(report) == want


def test_auto_moves_to_the_k_whose_steps_carry_no_more_than_k1s_schedule_overlapped():
    """K=1 copies 12 MiB of state on one device; its schedule overlapped 9 MiB and serialized
    3 MiB, although the step's time (1 s, a link of 100 MiB/s) would hide all of it.
    Reference: the cost model's own rule, run directly with and without that cap
    (gradients: a third of the state, so K=2's steps carry 4/7 of it, 6.9 MiB, which fits)."""
    state, grads, link = 12 * MIB, 4 * MIB, 100 * MIB
    k1 = types.SimpleNamespace(
        phases=(program((9 * MIB, 0, 100, True), (3 * MIB, 0, 0, True)),),
        target=types.SimpleNamespace(host_link_bytes_per_s=link, devices=[0]),
        plan=types.SimpleNamespace(state_bytes=state, grad_bytes=grads))
    cost = predict.StepCost(FLOPS, None, 1.0, "test")
    choice = predict.auto_choice(k1, cost, [10, 50])
    assert choice.capacity_bytes == 9 * MIB
    assert choice.by_interval == {10: 2, 50: 2} and choice.best == 2

    def k_with(capacity):
        return costmodel.choose_k(costmodel.TrainingProfile(
            step_time_s=1.0, d2h_bytes_per_s=link, state_bytes=state, grad_bytes=grads,
            persist_bytes_per_s=predict.BACKGROUND_BYTES_PER_S, overlappable_fraction=choice.fraction,
            schedule_capacity_bytes=capacity))
    assert (k_with(None), k_with(9 * MIB)) == (1, 2)
