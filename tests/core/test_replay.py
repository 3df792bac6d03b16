"""core.replay: the host replay's arguments keep the device's tree, and a plan is rehearsed
on zeros of the real shapes before its first window."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from overlap_ckpt.core import replay as replay_module
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


@pytest.mark.parametrize("chunk_leaves", [None, False])
def test_a_replay_call_computes_only_the_leaves_it_advances(chunk_leaves):
    """The host keeps a call's advanced leaves only, so its program must not compute the
    stand-ins' updates too. It did: every call ran Adam over the whole tree (full-sized
    stand-ins in a whole-leaf plan: 3x the host time per window, ``bench_engine
    --whole-leaves``), and each compiled program grew with the tree (XLA:CPU keeps memory
    per operation: the 20M LM's K=3 replay programs held 41 MiB, 24 MiB without them).
    Adam takes one square root per leaf: the compiled program has one per advanced leaf."""
    tx = optax.adam(1e-2)
    params = make_params([(64, 32), (48, 32)] + [(3 + i, 5) for i in range(10)])
    plan = make_plan(tx, params, tx.init(params), None, 3, chunk_leaves=chunk_leaves)
    assert plan.chunked is (chunk_leaves is None)
    programs = ReplayPrograms(plan)
    n = len(plan.params)
    calls = list(programs._calls())
    assert calls
    for i, args, injected, advanced in calls:
        moving, fixed = replay_module._split(args, advanced)
        with jax.default_device(programs.cpu):
            hlo = programs._run.lower(moving, fixed, injected, list(moving), replay_module.TRUE).compile().as_text()
        roots = len(re.findall(r"= f32\[[0-9,]*\]\{?[0-9,]*\}? sqrt\(", hlo))
        assert roots == sum(x < n for x in advanced), (i, advanced)
