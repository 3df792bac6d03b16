"""A user's own step checked for a target in one call (``CheckpointManager.aot_report``,
``overlap_ckpt.aot.report_step``, ``overlap-ckpt aot --step``), from the arguments the user
holds on this machine: concrete arrays FSDP-sharded over a ('data', 'fsdp') mesh of this
process's devices (``tests/aot/user_steps.py``).

Independent references: the plain program is compared with Flax's own ``TrainState`` (or
``nnx.Optimizer``) step, jitted and placed on the target by hand here; the shardings with
the arguments' own ``PartitionSpec``s; "auto"'s K with the cost model's rule called on
numbers this test computes from the state; a window-only device copy of a donated leaf
must come back as a failed check naming the leaf. The ``cpu`` target needs no plugin;
the ``h100`` tests (names containing h100) run in CI's job with the CUDA plugin, the
``v5e`` ones where libtpu is installed.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import overlap_ckpt as oc
from overlap_ckpt.aot import (AotCheckError, PlacementError, StepError, Target, UserStep, get_target, predict,
                              report_step)
from overlap_ckpt.aot.placement import Placement
from overlap_ckpt.aot.programs import compile_program
from overlap_ckpt.aot.user_step import lower_in_window, plan_state
from overlap_ckpt.aot.window import compiled_phases
from overlap_ckpt.aot.outbox import GRADIENTS, STATE
from overlap_ckpt.costmodel import window_transfer_bytes
from overlap_ckpt.costmodel.window import choose_window
from overlap_ckpt.manager.copy_schedule import PARALLEL_LIMIT_OPTION, CopyScheduleHints
from overlap_ckpt import aot
from overlap_ckpt.tools import cli

from conftest import REPO, run_python
from e2e.test_docs_snippets import python_blocks, with_setup

from . import user_steps
from .conftest import TPU_TARGET, target_or_skip

DOCS = os.path.join(REPO, "docs", "aot.md")

INTERVAL = 10


@pytest.fixture(scope="module")
def cpu():
    return get_target("cpu", host_gbps=10)


def manager(tmp_path, window):
    return oc.CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=window)


def specs(tree):
    return [x.sharding.spec if isinstance(x.sharding, NamedSharding) else None for x in jax.tree.leaves(tree)]


def on_mesh_of(target: Target, names=("data", "fsdp"), shape=None):
    """The target's devices on a mesh of these axes, built here, not by the placement."""
    n = len(target.devices)
    return Mesh(np.array(target.devices, dtype=object).reshape(shape or (1, n)), names)


def reference_fingerprint(target, mesh):
    """Flax's own TrainState step, its arguments placed on ``mesh`` by hand, compiled."""
    x = jax.ShapeDtypeStruct((user_steps.BATCH, user_steps.IN), np.float32,
                             sharding=NamedSharding(mesh, PartitionSpec("data")))
    y = jax.ShapeDtypeStruct((user_steps.BATCH, user_steps.OUT), np.float32, sharding=x.sharding)
    lowered = user_steps.flax_reference(lambda spec: NamedSharding(mesh, spec), x, y)
    return compile_program("reference", lowered)[0].fingerprint


# -- placement, no compile ---------------------------------------------------------------------

def test_placement_keeps_each_partition_spec_and_replicates_the_rest():
    here = Target("here", "cpu", tuple(jax.devices()), 1.0, 1.0, 1.0, float("inf"), "test")
    user = user_steps.linen_fsdp()
    (state, x, y), _ = Placement(here).arguments(user.args, {})
    assert specs(state) == specs(user.args[0]) and specs(x) == [PartitionSpec("data")]
    leaf = state.params["hidden"]["kernel"]
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding.mesh.axis_names == ("data", "fsdp")
    assert tuple(leaf.sharding.mesh.devices.flat) == here.devices
    single = jax.device_put(np.ones(3), jax.devices()[0])
    moved, _ = Placement(here).arguments((single, np.ones(2), 7), {})
    assert [m.sharding.spec for m in moved[:2]] == [PartitionSpec(), PartitionSpec()] and moved[2] == 7


def test_v5e_placement_gives_the_largest_axis_every_chip_or_the_shape_asked():
    target = target_or_skip(TPU_TARGET)
    user = user_steps.linen_fsdp()
    (state, _, _), _ = Placement(target).arguments(user.args, {})
    kernel = state.params["hidden"]["kernel"]
    assert dict(kernel.sharding.mesh.shape) == {"data": 1, "fsdp": 4}
    assert kernel.sharding.spec == PartitionSpec("fsdp")
    assert kernel.sharding.shard_shape(kernel.shape) == (user_steps.IN // 4, user_steps.HIDDEN)
    (state, _, _), _ = Placement(target, {"data": 2, "fsdp": 2}).arguments(user.args, {})
    assert dict(state.params["hidden"]["kernel"].sharding.mesh.shape) == {"data": 2, "fsdp": 2}
    with pytest.raises(PlacementError, match="mesh_shape .* must give every axis"):
        Placement(target, {"data": 4}).arguments(user.args, {})
    odd = jax.ShapeDtypeStruct((6, 4), np.float32, sharding=user.args[0].params["hidden"]["kernel"].sharding)
    with pytest.raises(PlacementError, match=r"args\[0\]\['w'\] \(shape \(6, 4\)\) is split on dimension 0 .*"
                                             r"4 ways.*mesh_shape="):
        Placement(target).arguments(({"w": odd},), {})


# -- the cpu target, no plugin -----------------------------------------------------------------

def test_cpu_linen_fsdp_manager_report(cpu, tmp_path):
    user = user_steps.linen_fsdp()
    with manager(tmp_path, window=2) as mngr:
        state = mngr.prepare(user.args[0])
        report = mngr.aot_report(user.step, state, *user.args[1:], target=cpu)
    assert report.k == 2 and list(report.windows) == [2] and report.labels == {2: "window=2"}
    assert report.ok and report.windows[2].plain_is_users_program
    assert report.windows[2].plain.fingerprint == reference_fingerprint(cpu, on_mesh_of(cpu))
    assert specs(report.arguments[0][0]) == specs(state)
    text = report.markdown()
    assert "# overlap-ckpt aot: your step `train_step` on cpu" in text and "- K=2: pass" in text
    assert "overlap K=2 (window=2)" in text and "Orbax async" in text
    assert "the K the manager would use: 2 (window=2)" in text


def test_cpu_nnx_manager_report(cpu, tmp_path):
    user = user_steps.nnx_fsdp()
    model, optimizer, x, y = user.args
    with manager(tmp_path, window=1) as mngr:
        mngr.prepare(optimizer, model)
        report = mngr.aot_report(user.step, model, optimizer, x, y, target=cpu)
    assert report.k == 1 and list(report.windows) == [1] and report.ok
    flax_model, flax_optimizer = user_steps.nnx_objects(nnx.Optimizer)  # Flax's own optimizer, same step
    reference = compile_program("reference", user_steps.nnx_train_step.lower(flax_model, flax_optimizer, x, y))[0]
    assert report.windows[1].plain.fingerprint == reference.fingerprint
    moved_model = report.arguments[0][0]
    assert moved_model.l1.kernel.get_value().sharding.spec == PartitionSpec("fsdp")


def test_cpu_auto_k_is_the_cost_model_rule_at_the_managers_interval(cpu, tmp_path):
    user = user_steps.linen_fsdp()
    with manager(tmp_path, window="auto") as mngr:
        state = mngr.prepare(user.args[0])
        report = mngr.aot_report(user.step, state, *user.args[1:], target=cpu)
    leaves = jax.tree.leaves((state.params, state.opt_state, state.step))
    state_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    fraction = predict.schedule_fraction(report.windows[1])
    expected = choose_window(report.cost.step_time_s, cpu.host_link_bytes_per_s, state_bytes, grad_bytes,
                             predict.BACKGROUND_BYTES_PER_S, INTERVAL,
                             overlappable_fraction=predict.OVERLAPPABLE_FRACTION if fraction is None else fraction)
    assert report.k == expected and expected in report.windows
    assert report.auto.by_interval == {INTERVAL: expected} and report.intervals == (INTERVAL,)
    assert f"auto at N={INTERVAL}" in report.labels[expected]


def test_v5e_auto_k_follows_the_managers_interval(tmp_path):
    """Checkpointing every step, a window cannot span two: K=1 at the manager's interval,
    though the K of least stall for the same step is larger."""
    target = target_or_skip(TPU_TARGET)
    user = user_steps.linen_fsdp()
    with oc.CheckpointManager(tmp_path, save_interval_steps=1, window="auto") as mngr:
        state = mngr.prepare(user.args[0])
        report = mngr.aot_report(user.step, state, *user.args[1:], target=target)
    assert report.auto.best > 1 and report.k == 1 and report.auto.by_interval == {1: 1}
    assert "auto at N=1" in report.labels[1] and "best" in report.labels[report.auto.best]


@pytest.mark.slow
def test_v5e_auto_moves_past_a_k1_window_whose_schedule_serializes_copies():
    """XLA:TPU keeps a few host copies in flight, so a wide MLP with a short step gets some of
    K=1's copies over 1 MiB issued with nothing computing. "auto" reads the bytes K=1's
    schedule did overlap and moves to a K whose steps carry no more, even where the step's
    time would hide them all (a step measured long enough to copy the state twice under the
    share some copy is in flight: the cost model's rule then keeps K=1 without the cap).
    References: the copies read from the compiled K=1 phase, the cost model's rule called
    directly. Only that phase is compiled (the check naming a serialized copy is
    test_check.py's); that the K chosen then compiles with nothing serialized is the 100M
    LM's measurement (benchmarks/results/aot_v5e_2x2_100m_batch2.md)."""
    target = target_or_skip(TPU_TARGET)
    user = user_steps.linen_deep()
    placement = Placement(target)
    args, kwargs = placement.arguments(user.args, user.kwargs)
    in_window = lower_in_window(placement.step(user.step), *args, **kwargs)

    def lower(ticket):
        with placement.lowering():
            return in_window(ticket)

    plan = plan_state(args[0], 1, rehearse=False)
    ((phase, _),) = compiled_phases(lower, plan)
    k1 = aot.WindowReport(target, plan, None, (phase,), None)
    serialized = [c for c in phase.host_copies if not c.overlapped and c.nbytes > 2**20]
    assert serialized, [(c.leaf, c.nbytes, c.overlapped) for c in phase.host_copies]
    overlapped = sum(c.nbytes for c in phase.host_copies if c.overlapped)
    devices = len(target.devices)
    state, grads = plan.state_bytes / devices, plan.grad_bytes / devices
    fraction = predict.schedule_fraction(k1)
    long_step = predict.StepCost(phase.matmul_flops, None, 2 * state / (fraction * target.host_link_bytes_per_s),
                                 "a step measured that long")
    choice = predict.auto_choice(k1, long_step, [INTERVAL])
    assert choice.capacity_bytes == overlapped and choice.fraction == fraction
    rule = (long_step.step_time_s, target.host_link_bytes_per_s, state, grads, predict.BACKGROUND_BYTES_PER_S,
            INTERVAL)
    assert choose_window(*rule, overlappable_fraction=fraction) == 1
    k = choose_window(*rule, overlappable_fraction=fraction, schedule_capacity_bytes=overlapped)
    assert k > 1 and choice.by_interval == {INTERVAL: k}
    assert window_transfer_bytes(state, grads, k)[0] <= overlapped


def test_refusals_name_the_cause_and_the_fix(cpu, tmp_path):
    user = user_steps.linen_fsdp()
    with manager(tmp_path, window=1) as mngr:
        with pytest.raises(RuntimeError, match=r"call prepare\(\) first"):
            mngr.aot_report(user.step, *user.args, target=cpu)
    with pytest.raises(ValueError, match="copy schedule hint is XLA:GPU's"):
        report_step(user, cpu, hints=CopyScheduleHints(str(tmp_path)))
    with pytest.raises(PlacementError, match="must be jitted"):
        report_step(UserStep(user_steps.train_step, user.args), cpu)
    with pytest.raises(StepError, match="none of the step's arguments is a state"):
        report_step(UserStep(user.step, user.args[1:]), cpu)
    with pytest.raises(StepError, match="UserStep"):
        report_step(("only a step",), cpu)
    with pytest.raises(ValueError, match="window sizes are ints >= 1"):
        report_step(user, cpu, window=0)


def test_cpu_command_line_step(cpu, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(aot, "get_target", lambda name, host_gbps=None: cpu)  # measured once, above
    out = tmp_path / "report.md"
    spec = f"{user_steps.__file__}:linen_fsdp"
    assert cli.main(["aot", "--step", spec, "--target", "cpu", "--k", "1", "--output", str(out), "--check"]) == 0
    text = out.read_text()
    assert "your step `train_step` on cpu" in text and "overlap K=1 (given)" in text and "**yes**" in text
    assert cli.main(["aot", "--step", "no/such/file.py:f", "--target", "cpu"]) == 1
    assert cli.main(["aot", "--step", spec, "--model", "tiny", "--target", "cpu"]) == 1
    assert cli.main(["aot", "--step", spec, "--mesh-shape", "data:2", "--target", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "no file no/such/file.py" in err and "--model, --batch-per-device" in err and "axis=size" in err
    assert "Traceback" not in err


# -- compile-only accelerators -----------------------------------------------------------------

def test_h100_linen_fsdp_report_is_the_users_program_and_passes(tmp_path):
    target = target_or_skip("h100")
    user = user_steps.linen_fsdp()
    with manager(tmp_path, window=2) as mngr:
        state = mngr.prepare(user.args[0])
        report = mngr.aot_report(user.step, state, *user.args[1:], target="h100")
    assert report.k == 2 and report.ok, report.violations
    assert report.windows[2].plain.fingerprint == reference_fingerprint(target, on_mesh_of(target))
    facts = report.phases()
    assert [(f.k, f.phase) for f in facts] == [(2, 0), (2, 1)] and all(f.host_copies for f in facts)
    assert not [c for c in report.copies() if c.serialized]
    assert report.stall_s(2) >= 0 and report.orbax_stall_s > 0


def test_h100_copy_hints_copy_leaf_by_leaf_from_the_top(tmp_path):
    target_or_skip("h100")
    user = user_steps.linen_fsdp()
    with manager(tmp_path, window=2) as mngr:
        state = mngr.prepare(user.args[0])
        report = mngr.aot_report(user.step, state, *user.args[1:], target="h100", copy_hints=True)
    window = report.windows[2]
    assert not window.plan.pack_outbox and report.ok and window.plain_is_users_program
    state_copies = [c for c in report.copies() if c.kind == STATE]
    assert len(state_copies) >= len(jax.tree.leaves((state.params, state.opt_state)))  # one per leaf, or more
    late = [c for c in state_copies if c.after_start < 0.9]
    assert not late, late
    assert PARALLEL_LIMIT_OPTION in report.markdown()


def test_h100_nnx_jit_copies_are_labelled_by_what_they_carry(tmp_path):
    """An nnx.jit step's lowering wraps jax's, whose outputs name the outbox: the state copies
    are told from the gradient pieces (what the copy hint's profile costs differently)."""
    target_or_skip("h100")
    user = user_steps.nnx_fsdp()
    model, optimizer, x, y = user.args
    with manager(tmp_path, window=2) as mngr:
        mngr.prepare(optimizer, model)
        report = mngr.aot_report(user.step, model, optimizer, x, y, target="h100")
    kinds = [(c.phase, c.kind) for c in report.copies()]
    assert (0, STATE) in kinds and (0, GRADIENTS) in kinds and (1, STATE) in kinds, kinds
    assert {kind for _, kind in kinds} == {STATE, GRADIENTS} and report.ok


@pytest.mark.parametrize("line,code", [pytest.param(line, code, id=f"aot.md:{line}")
                                       for line, code, setup in python_blocks(DOCS) if setup == "aot_h100"])
def test_h100_docs_examples_run(line, code, tmp_path):
    """docs/aot.md's h100 examples (the tiny Linen LM, FSDP; the NNX LM with the copy hint), as
    tests/e2e/test_docs_snippets.py runs them, here where the CUDA plugin is (CI's h100 job)."""
    target_or_skip("h100")
    result = run_python(with_setup(code, "aot_h100"), timeout=300, compile_cache=False)
    assert result.returncode == 0 and "K=" in result.stdout, (line, result.stdout[-2000:], result.stderr[-4000:])


def test_h100_window_only_device_copy_of_a_donated_leaf_fails_naming_it():
    target_or_skip("h100")
    report = report_step(user_steps.linen_keeping_a_leaf_in_windows(), "h100", window=1)
    (found,) = report.violations[1]
    assert "state.params['hidden']['kernel'] (2.0 MiB) is copied within device memory" in found
    assert not report.ok and "**1 violation(s)**" in report.markdown()
    with pytest.raises(AotCheckError, match=r"K=1: phase 0: state\.params\['hidden'\]\['kernel'\]"):
        report.check()


def test_v5e_fsdp_over_every_chip_is_the_users_program():
    target = target_or_skip(TPU_TARGET)
    report = report_step(user_steps.linen_fsdp(), target, window=2)
    assert report.ok, report.violations
    assert report.windows[2].plain.fingerprint == reference_fingerprint(target, on_mesh_of(target))
    assert "mesh {'data': 1, 'fsdp': 1} -> {'data': 1, 'fsdp': 4}" in report.markdown()


def test_v5e_explicit_axes_under_set_mesh_are_moved_and_body_shardings_refused():
    """``jax.set_mesh``'s mesh is moved for the lowering (an explicit-axis loop, docs/porting.md);
    a sharding the step's body names on this machine's mesh cannot be, and is refused with the fix."""
    target = target_or_skip(TPU_TARGET)
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)

    @jax.jit
    def step(state, x):
        def loss_fn(p):
            w = jax.sharding.reshard(p["w"], PartitionSpec())  # all-gathered for the forward
            return jnp.sum(jnp.tanh(x @ w) ** 2)
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    with jax.set_mesh(mesh):
        params = {"w": jax.sharding.reshard(jnp.ones((64, 64)), PartitionSpec("fsdp"))}
        state = oc.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
        x = jax.sharding.reshard(jnp.ones((8, 64)), PartitionSpec("data"))
        report = report_step(UserStep(step, (state.replace(step=jnp.asarray(0, jnp.int32)), x)), target, window=1)
    assert report.ok and report.windows[1].plain_is_users_program
    assert dict(report.arguments[0][0].params["w"].sharding.mesh.shape) == {"data": 1, "fsdp": 4}

    here = NamedSharding(user_steps.mesh(), PartitionSpec("data"))
    user = user_steps.linen_fsdp()

    @jax.jit
    def pinned(state, x, y):
        return user_steps.train_step(state, jax.lax.with_sharding_constraint(x, here), y)

    with pytest.raises(PlacementError, match="body names shardings of this machine's devices.*jax.set_mesh"):
        report_step(UserStep(pinned, user.args), target, window=1)
