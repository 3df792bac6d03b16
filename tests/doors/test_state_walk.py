"""Nothing of overlap_ckpt is visible in the state the user's loop holds.

Code that walks a train state (sharding reports, parameter counts, ``jax.tree.map`` over
``nnx.state(optimizer)``, EMA copies, Flax state dicts) must see exactly what Flax's own
class shows, at every step of a loop with checkpoint windows (before, inside and after a
window, and after a resume). The reference is the Flax class itself, trained side by side
on the same data: ``flax.training.train_state.TrainState`` and ``flax.nnx.Optimizer``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, serialization
from flax.training import train_state

import overlap_ckpt as oc

INTERVAL, WINDOW, STEPS = 4, 2, 10  # windows at steps 3-4 and 7-8
X = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(6, 4)
Y = np.linspace(0.0, 1.0, 18, dtype=np.float32).reshape(6, 3)


def tx():
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3))


# -- the walks a user's code does --------------------------------------------------------
def walk_pytree(tree) -> list:
    """Path, shape, dtype and bytes of every leaf (``jax.tree`` utilities)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x.shape, str(x.dtype), np.asarray(x).tobytes()) for p, x in leaves]


def walk_state_dict(tree) -> dict:
    """Flax state dict as nested keys with array bytes."""
    return jax.tree.map(lambda x: (np.shape(x), np.asarray(x).tobytes()), serialization.to_state_dict(tree))


def walk_nnx(obj) -> list:
    """What a sharding report over ``nnx.to_flat_state(nnx.state(obj))`` reads (Flax's
    examples print ``.shape``, ``.dtype`` and the value of every variable)."""
    return [(tuple(path), type(v).__name__, v.shape, str(v.dtype), np.asarray(v[...]).tobytes(),
             sorted(k for k in v.get_metadata() if k != "sharding"))
            for path, v in nnx.to_flat_state(nnx.state(obj))]


def nnx_views(obj) -> dict:
    """The other everyday views: filters, split, tree maps, parameter counts."""
    state = nnx.state(obj)
    return {
        "params": walk_pytree(nnx.state(obj, nnx.Param)),
        "opt": walk_pytree(nnx.state(obj, nnx.OptState)) if isinstance(obj, nnx.Optimizer) else None,
        "zeros": walk_pytree(jax.tree.map(jnp.zeros_like, state)),
        "count": sum(x.size for x in jax.tree.leaves(state)),
        "split": walk_pytree(nnx.split(obj)[1]),
    }


# -- Linen -------------------------------------------------------------------------------
MODEL = nn.Dense(3)


def params():
    """Fresh arrays each time: the steps donate their input state."""
    return MODEL.init(jax.random.key(0), X)["params"]


def loss_of(apply_fn, params):
    return jnp.mean((apply_fn({"params": params}, X) - Y) ** 2)


@functools.partial(jax.jit, donate_argnums=0)
def linen_step(state):
    return state.apply_gradients(grads=jax.grad(functools.partial(loss_of, state.apply_fn))(state.params))


def test_linen_state_is_flax_trainstate_at_every_step(tmp_path):
    shared_tx = tx()
    flax_state = train_state.TrainState.create(apply_fn=MODEL.apply, params=params(), tx=shared_tx)
    flax_state = flax_state.replace(step=jnp.int32(0))
    with oc.CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        state = mngr.prepare(oc.TrainState.create(apply_fn=MODEL.apply, params=params(), tx=shared_tx))
        phases = set()
        for t in range(STEPS):
            phases.add(mngr.next_window_phase)
            _check_linen(state, flax_state, f"step {t}")
            state = mngr.step(linen_step(state))
            flax_state = linen_step(flax_state)
        assert phases == {None, 0, 1}  # plain steps and both phases were walked
        mngr.wait_until_finished()
    with oc.CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        state = mngr.restore(target_state=oc.TrainState.create(apply_fn=MODEL.apply, params=params(), tx=shared_tx))
        _check_linen(state, flax_state, "after resume")
        state = mngr.step(linen_step(state))
        _check_linen(state, flax_state, "first step after resume")


def _check_linen(state, flax_state, what):
    """Same leaves (paths, shapes, dtypes) as Flax's, same state dict keys, and state dicts
    that move between the two classes both ways."""
    _check_structure(state, flax_state, what)
    moved = serialization.from_state_dict(flax_state, serialization.to_state_dict(state))
    assert walk_state_dict(moved) == walk_state_dict(state), what
    back = serialization.from_state_dict(state, serialization.to_state_dict(flax_state))
    assert isinstance(back, oc.TrainState)


def _check_structure(state, flax_state, what):
    ours, theirs = walk_pytree(state), walk_pytree(flax_state)
    assert [leaf[:3] for leaf in ours] == [leaf[:3] for leaf in theirs], what
    ours_dict = serialization.to_state_dict(state)
    assert jax.tree.structure(jax.tree.map(np.shape, ours_dict)) == \
        jax.tree.structure(jax.tree.map(np.shape, serialization.to_state_dict(flax_state))), what


# -- NNX ---------------------------------------------------------------------------------
class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.linear2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.bn(self.linear1(x))))


def nnx_loss(model):
    return jnp.mean((model(X) - Y) ** 2)


@nnx.jit(donate_argnums=(0, 1))
def nnx_step(model, optimizer):
    grads = nnx.grad(nnx_loss)(model)
    optimizer.update(model, grads)


@functools.partial(jax.jit, donate_argnums=1)
def functional_step(graphdef, state):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(nnx_loss)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))


def nnx_pair(cls, shared_tx):
    model = MLP(nnx.Rngs(0))
    return model, cls(model, shared_tx, wrt=nnx.Param)


def _check_nnx(ours, theirs, what, *, values=True):
    """``ours`` (an overlap_ckpt.nnx.Optimizer) walks like ``theirs`` (nnx.Optimizer);
    with ``values``, bit for bit."""
    a, b = walk_nnx(ours), walk_nnx(theirs)
    strip = (lambda rows: rows) if values else (lambda rows: [r[:4] + r[5:] for r in rows])
    assert strip(a) == strip(b), what
    va, vb = nnx_views(ours), nnx_views(theirs)
    if not values:
        va, vb = ({k: [r[:3] for r in v] if isinstance(v, list) else v for k, v in d.items()} for d in (va, vb))
    assert va == vb, what


def test_nnx_optimizer_walks_like_flax_at_every_step(tmp_path):
    shared_tx = tx()
    model, optimizer = nnx_pair(oc.nnx.Optimizer, shared_tx)
    ref_model, reference = nnx_pair(nnx.Optimizer, shared_tx)
    graphdef = nnx.graphdef(optimizer)
    with oc.CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        mngr.prepare(optimizer, model)
        phases = set()
        for t in range(STEPS):
            phases.add(mngr.next_window_phase)
            # Window steps isolate the gradients and may round differently from a loop without
            # checkpoints (by design): compare values up to the first window, structure after.
            _check_nnx(optimizer, reference, f"step {t}", values=t < INTERVAL - WINDOW + 1)
            assert nnx.graphdef(optimizer) == graphdef, f"step {t}: the graph changed"
            nnx_step(model, optimizer)
            mngr.step(optimizer)
            nnx_step(ref_model, reference)
        assert phases == {None, 0, 1}
        mngr.wait_until_finished()
    model, optimizer = nnx_pair(oc.nnx.Optimizer, shared_tx)
    with oc.CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        mngr.restore(target_state=optimizer, model=model)
        _check_nnx(optimizer, reference, "after resume", values=False)
        assert nnx.graphdef(optimizer) == graphdef


def test_functional_nnx_state_walks_like_flax_at_every_step(tmp_path):
    shared_tx = tx()
    graphdef, state = nnx.split(nnx_pair(oc.nnx.Optimizer, shared_tx))
    ref_graphdef, ref_state = nnx.split(nnx_pair(nnx.Optimizer, shared_tx))
    with oc.CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=WINDOW) as mngr:
        state = mngr.prepare(state, graphdef=graphdef)
        phases = set()
        for t in range(STEPS):
            phases.add(mngr.next_window_phase)
            ours, theirs = (nnx.merge(g, s)[1] for g, s in ((graphdef, state), (ref_graphdef, ref_state)))
            _check_nnx(ours, theirs, f"step {t}", values=t < INTERVAL - WINDOW + 1)
            assert [r[:3] for r in walk_pytree(state)] == [r[:3] for r in walk_pytree(ref_state)], f"step {t}"
            state = mngr.step(functional_step(graphdef, state))
            ref_state = functional_step(ref_graphdef, ref_state)
        assert phases == {None, 0, 1}
        mngr.wait_until_finished()


PMAP_WALK = r"""
import functools, tempfile
import flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
from flax import jax_utils, serialization
from flax.training import train_state
import overlap_ckpt as oc

model = nn.Dense(3)
x = np.linspace(-1, 1, 2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
tx = optax.adam(1e-2)


def make(cls):
    return cls.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x[0])["params"], tx=tx)


def step(state, xb):
    grads = jax.lax.pmean(jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, xb) ** 2))(state.params), "d")
    return state.apply_gradients(grads=grads)


def walk(state):
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return ([(jax.tree_util.keystr(p), v.shape, str(v.dtype)) for p, v in leaves],
            jax.tree.structure(jax.tree.map(np.shape, serialization.to_state_dict(state))))


for name, kwargs, prepare in [("replicated", {}, jax_utils.replicate),
                              ("broadcast", {"in_axes": (None, 0), "out_axes": None}, lambda s: s)]:
    p_step = jax.pmap(step, axis_name="d", **kwargs)
    flax_state = prepare(make(train_state.TrainState))
    if name == "broadcast":
        flax_state = flax_state.replace(step=jnp.int32(0))
    with oc.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=4, window=2) as mngr:
        state = mngr.prepare(prepare(make(oc.TrainState)))
        phases = set()
        for t in range(10):
            phases.add(mngr.next_window_phase)
            assert walk(state) == walk(flax_state), (name, t, walk(state), walk(flax_state))
            state = mngr.step(p_step(state, x))
            flax_state = p_step(flax_state, x)
        assert phases == {None, 0, 1}, phases
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8], mngr.all_steps()
print("walked")
"""


def test_pmap_states_walk_like_flax_at_every_step():
    """jax.pmap, replicated and broadcast (``in_axes=None``): the state between steps is
    Flax's, window or not (two simulated devices, in a fresh interpreter)."""
    from conftest import run_python

    proc = run_python(PMAP_WALK, devices=2)
    assert proc.returncode == 0 and "walked" in proc.stdout, proc.stderr[-4000:]
