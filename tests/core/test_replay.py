"""core.replay: the host replay's arguments keep the device's tree, and a plan is rehearsed
on zeros of the real shapes before its first window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from overlap_ckpt.core.plan import make_plan
from overlap_ckpt.core.replay import ReplayPrograms

from conftest import make_params


def test_arguments_put_slices_in_place_and_stand_ins_elsewhere():
    tx = optax.adam(1e-2)
    params = make_params([(8, 3), (5,)])
    plan = make_plan(tx, params, tx.init(params), {"step": jnp.int32(0)}, 2)
    programs = ReplayPrograms(plan)
    first = plan.slicing.slices[0]
    leaf = first[0].leaf
    shape = programs.gathered(plan.params[leaf], first[0])
    assert shape.shape[0] == first[0].stop - first[0].start
    gathered = np.zeros(shape.shape, shape.dtype)
    args = programs.arguments({leaf: gathered}, {}, {leaf: gathered}, [np.zeros((), np.int32)])
    n, m = len(plan.params), len(plan.state)
    assert len(args) == 2 * n + m and args[leaf] is gathered
    other = 1 - leaf
    assert args[other].shape[0] == 1  # a one-row stand-in (elementwise update)


def test_rehearse_traces_every_phase_and_whole_leaf_stand_ins_keep_shapes():
    tx = optax.adafactor(1e-2)
    params = make_params([(256, 192), (48,)])
    plan = make_plan(tx, params, tx.init(params), None, 2)
    assert not plan.chunked  # the factored statistics reduce within the leaf
    programs = ReplayPrograms(plan)
    programs.rehearse()  # raises if a phase cannot be replayed (traced, not compiled)
    assert programs.dummy(plan.params[0]).shape == (256, 192)  # adafactor picks code by shape
    assert jax.tree.structure(programs.dummy_state()) == jax.tree.structure([0] * len(plan.state))
