"""Where XLA:GPU starts a window's host copies with the copy schedule hint
(``CheckpointManager.jit_compiler_options`` and ``compile_ahead``), compile-only H100, on the
small Linen and NNX LMs, every phase of K = 1 and 2.

The hint is three things together (overlap_ckpt.manager.copy_schedule): one copy per leaf
(the plan does not pack), a latency profile costing every copy-start of every capturing
phase, and ``xla_gpu_experimental_parallel_async_compute_limit``. With all three, every copy
of the state starts before the step's matmuls, no copy is serialized, and the phases need
no device memory beyond the plain step's but a small fixed layout allowance (the copies
read buffers the step holds anyway). Each check names the phase and the copy that breaks it,
and each is seen to fail when one part of the hint is left out (the ``_seen_red`` tests).

References: the positions are counted in the compiled program's own schedule, the share of
the step's matmul flops after each copy starts (``aot.hlo.scheduled_flops``, checked in
test_hlo.py); what a copy carries comes from the outbox it lands in (``aot.outbox``), not
from the compiled program; memory is the plain step's, compiled in the same jit; the plain
step is compared with the step jitted without the options.
"""

import dataclasses

import jax
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import overlap_ckpt as oc
from overlap_ckpt.aot import compile_window, lower_in_window, plan_state
from overlap_ckpt.aot.programs import compile_program
from overlap_ckpt.aot.window import compiled_phases
from overlap_ckpt.aot.outbox import GRADIENTS, STATE
from overlap_ckpt.core.ticket import WindowTicket
from overlap_ckpt.manager import copy_schedule
from overlap_ckpt.manager.copy_schedule import PARALLEL_LIMIT_OPTION, PGLE_OPTION, CopyScheduleHints
from overlap_ckpt.tools.aot.lm_step import lm_setup, lower_reference, lower_with, plan_window
from overlap_ckpt.tools.models import LMConfig, TransformerLM, linen_loss_fn

from .conftest import target_or_skip

KS = (1, 2)
# A state copy reads the step's inputs: it should start with at least this share of the
# step's matmul flops still to run (issue 56).
STATE_COPY_AFTER_START = 0.9
# A copy serialized above this many bytes fails. The bound is 1 MiB (a larger model's
# copies); the tiny models' copies are all smaller, so here none may be serialized.
MAX_SERIALIZED_BYTES = 0
# Device memory a phase may need beyond the plain step: a layout allowance that does not
# grow with the state. Measured: 34-454 KiB for these models (the 1B LM: +1.4 MiB at batch
# 16, benchmarks/results/aot_h100_1b_hinted.md); the packed outbox needed its bytes.
MAX_EXTRA_BYTES = 1 << 20


def late_state_copies(phases) -> list[str]:
    return [f"{p.name}: the copy of {c.leaf} ({c.nbytes} B) starts with {p.after_start(c):.2f} of the step's "
            f"matmul flops after it (at least {STATE_COPY_AFTER_START} wanted)"
            for p in phases for c in p.host_copies
            if c.kind == STATE and p.after_start(c) < STATE_COPY_AFTER_START]


def serialized_copies(phases, max_bytes: int = MAX_SERIALIZED_BYTES) -> list[str]:
    return [f"{p.name}: the copy of {c.leaf} ({c.nbytes} B, {c.kind}) is serialized: no compute runs while "
            "it transfers" for p in phases for c in p.host_copies if not c.overlapped and c.nbytes > max_bytes]


def extra_memory(phases, plain, bound: int = MAX_EXTRA_BYTES) -> list[str]:
    found = []
    for p in phases:
        extra = p.memory.peak - plain.memory.peak
        if extra > bound:
            found.append(f"{p.name}: {extra / 2**10:.0f} KiB of device memory beyond the plain step "
                         f"(at most {bound / 2**10:.0f} KiB; its outbox: {p.memory.host_output / 2**10:.0f} KiB)")
    return found


def windows(lower, plans, target, reference, prepare):
    """One report per plan; the plain step and the reference are compiled once for all."""
    first = compile_window(lower, plans[0], target, reference, prepare)
    return [first, *(dataclasses.replace(first, plan=plan, phases=phases(lower, plan, prepare)) for plan in plans[1:])]


def phases(lower, plan, prepare):
    return tuple(report for report, _ in compiled_phases(lower, plan, prepare))


def nnx_step(target, directory, options=None):
    """The tiny NNX LM (functional style) jitted as a user with the hint does: its setup,
    ``lower(ticket)`` and the hint. The options can be left out, one at a time."""
    setup = lm_setup(target, "tiny", batch_per_device=2, framework="nnx")
    hints = CopyScheduleHints(str(directory))
    return setup, lower_with(setup, hints.compiler_options() if options is None else options), hints


def nnx_windows(target, directory):
    """Its windows of K = 1 and 2, the phases compiled as compile_ahead does."""
    setup, lower, hints = nnx_step(target, directory)
    return windows(lower, [plan_window(setup, k, pack_outbox=False) for k in KS], target, lower_reference(setup),
                   hints.prepare)


def nnx_phases(target, directory, k, *, pack_outbox=False, options=None, profile=True):
    """Only the phases of its window of ``k`` steps, with one part of the hint left out."""
    setup, lower, hints = nnx_step(target, directory, options)
    return phases(lower, plan_window(setup, k, pack_outbox=pack_outbox), hints.prepare if profile else None)


def linen_windows(target, directory):
    """A Linen user's own step on ``overlap_ckpt.TrainState`` (FSDP-style shardings), jitted
    with the manager's options and compiled through the window context."""
    config = LMConfig.preset("tiny")
    model = TransformerLM(config)

    def create():
        params = model.init(jax.random.key(0), jax.numpy.zeros((1, config.seq_len), jax.numpy.int32))["params"]
        return oc.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))

    sharding = NamedSharding(target.mesh(), PartitionSpec())
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), jax.eval_shape(create))
    batch = {"tokens": jax.ShapeDtypeStruct((2, config.seq_len + 1), jax.numpy.int32, sharding=sharding)}

    def train_step(state, batch):
        grads = jax.grad(lambda p: linen_loss_fn(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=grads)

    hints = CopyScheduleHints(str(directory))
    shardings = jax.tree.map(lambda x: x.sharding, (state, batch))
    step = jax.jit(train_step, in_shardings=shardings, donate_argnums=0, compiler_options=hints.compiler_options())
    reference = jax.jit(train_step, in_shardings=shardings, donate_argnums=0).lower(state, batch)
    return windows(lower_in_window(step, state, batch), [plan_state(state, k, pack_outbox=False) for k in KS],
                   target, reference, hints.prepare)


@pytest.fixture(scope="module", params=["nnx", "linen"])
def hinted(request, tmp_path_factory):
    target = target_or_skip("h100")
    windows = nnx_windows if request.param == "nnx" else linen_windows
    return windows(target, tmp_path_factory.mktemp(f"hints-{request.param}"))


def test_h100_the_hint_copies_leaf_by_leaf_and_the_plain_step_is_the_users(hinted):
    for report in hinted:
        assert not report.plan.pack_outbox
        assert report.plain_is_users_program, (report.plain.fingerprint, report.reference.fingerprint)
        for program in report.phases:
            assert program.matmul_flops and all(c.asynchronous for c in program.host_copies), program.name
            kinds = {c.kind for c in program.host_copies}
            assert STATE in kinds and kinds <= {STATE, GRADIENTS}, (program.name, kinds)
            assert (GRADIENTS in kinds) == (program is not report.phases[-1]), (program.name, kinds)


def test_h100_every_state_copy_of_every_phase_starts_at_the_top(hinted):
    late = [line for report in hinted for line in late_state_copies(report.phases)]
    assert not late, "\n".join(late)


def test_h100_no_copy_is_serialized(hinted):
    serialized = [line for report in hinted for line in serialized_copies(report.phases)]
    assert not serialized, "\n".join(serialized)


def test_h100_device_memory_beyond_the_plain_step_is_a_small_fixed_bound(hinted):
    over = [line for report in hinted for line in extra_memory(report.phases, report.plain)]
    assert not over, "\n".join(over)
    for report in hinted:
        report.check()  # the library's own check agrees


# -- each check fails when a part of the hint is left out ---------------------------------------

@pytest.fixture(scope="module")
def h100():
    return target_or_skip("h100")


def test_h100_late_start_seen_red_with_one_cost_for_state_and_gradient_copies(h100, tmp_path, monkeypatch):
    """Given the cost of a gradient copy, XLA's scheduler (working back from the end) moves
    its clock past the state copies' cost when it places the first gradient copy, and then
    starts them wherever they land: 0.19-0.90 of the step after them in phase 0 of 2."""
    monkeypatch.setattr(copy_schedule, "state_cost_us", lambda others: copy_schedule.HINT_COST_US)
    late = late_state_copies(nnx_phases(h100, tmp_path, 2))
    assert late and all(line.startswith("phase 0 of 2: the copy of ") for line in late), late


def test_h100_late_start_seen_red_without_the_profile(h100, tmp_path):
    assert late_state_copies(nnx_phases(h100, tmp_path, 2, profile=False))


def test_h100_serialized_seen_red_without_the_parallel_limit(h100, tmp_path):
    options = {PGLE_OPTION: str(tmp_path)}  # no PARALLEL_LIMIT_OPTION: one copy in flight at a time
    serialized = serialized_copies(nnx_phases(h100, tmp_path, 1, options=options))
    assert serialized and serialized[0].startswith("phase 0 of 1: the copy of "), serialized


def test_h100_memory_seen_red_with_a_packed_outbox(h100, tmp_path):
    """The hint as it was before: the packed outbox, started at the top, holds its bytes on
    the device for the whole step."""
    setup, lower, hints = nnx_step(h100, tmp_path)
    plan = plan_window(setup, 1, pack_outbox=None)
    assert plan.pack_outbox
    over = extra_memory(phases(lower, plan, hints.prepare), compile_program("plain step", lower(None))[0])
    assert over and over[0].startswith("phase 0 of 1: "), over


def test_h100_options_carry_the_profile_directory_and_the_limit(tmp_path):
    hints = CopyScheduleHints(str(tmp_path))
    assert hints.compiler_options() == {PGLE_OPTION: str(tmp_path), PARALLEL_LIMIT_OPTION: "1000"}


def test_h100_every_capturing_gpu_phase_is_hinted(h100):
    setup = lm_setup(h100, "tiny", batch_per_device=2, framework="nnx")
    plan = plan_window(setup, 2, pack_outbox=False)
    assert CopyScheduleHints.wanted(WindowTicket(plan, 0)) and CopyScheduleHints.wanted(WindowTicket(plan, 1))
    assert not CopyScheduleHints.wanted(WindowTicket(plan, 0, capture=False))
