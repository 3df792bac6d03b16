"""Train-state layouts as users' jobs make them, for the layout tests (test_layouts.py) and
their worker (mp_layout_worker.py): a 3-layer MLP whose every dimension divides by 4, a
``PartitionSpec`` per parameter leaf and per non-scalar optimizer-state leaf, drawn
independently (so moments may be laid out otherwise than their parameters, as ZeRO-1 and
``jax.jit``'s own choices do), over 1-D and 2-D meshes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

SHAPES = {"l0": {"w": (16, 32), "b": (32,)}, "l1": {"w": (32, 32), "b": (32,)}, "l2": {"w": (32, 8), "b": (8,)}}
CHAINS = ("adam", "clip_adamw", "sgd_momentum", "lion")
CREATES = ("eager", "jit", "jit_out")
STEPS = ("plain", "keep")

Spec = list  # per dimension: None, an axis name, or a list of axis names


def make_tx(chain: str):
    import optax

    return {"adam": lambda: optax.adam(1e-2),
            "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=1e-2)),
            "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
            "lion": lambda: optax.lion(1e-3),
            # per-leaf reductions (factored moments): whole-leaf windows, not in CHAINS
            "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8)}[chain]()


def make_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {layer: {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in leaves.items()}
            for layer, leaves in SHAPES.items()}


def batch(t: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, t])
    return rng.standard_normal((8, 16), dtype=np.float32), rng.standard_normal((8, 8), dtype=np.float32)


def loss_fn(params, x, y):
    import jax.numpy as jnp

    h = x
    for i in range(3):
        h = h @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
        if i < 2:
            h = jnp.tanh(h)
    return jnp.mean((h - y) ** 2)


@dataclasses.dataclass(frozen=True)
class Case:
    """One job's layout and loop shape (JSON-serialisable, for the worker's command line)."""

    mesh_shape: tuple[int, ...]  # devices per mesh axis (axes "a", "b")
    param_specs: tuple[Spec, ...]  # per parameter leaf, in tree order
    opt_specs: tuple[Spec, ...]  # per non-scalar optimizer-state leaf, in tree order
    chain: str = "clip_adamw"
    create: str = "eager"
    step: str = "plain"
    window: int = 2
    local_every: int = 2
    durable_every: int = 6
    replicas: int = 0

    @property
    def axes(self) -> tuple[str, ...]:
        return ("a", "b")[:len(self.mesh_shape)]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        raw = json.loads(text)
        raw["mesh_shape"] = tuple(raw["mesh_shape"])
        raw["param_specs"], raw["opt_specs"] = tuple(raw["param_specs"]), tuple(raw["opt_specs"])
        return cls(**raw)

    def mesh(self):
        import jax
        from jax.sharding import Mesh

        return Mesh(np.array(jax.devices()).reshape(self.mesh_shape), self.axes)

    def create_state(self, host_params: dict, mesh) -> Any:
        """The train state on ``mesh``, created as :attr:`create` says."""
        import jax

        import overlap_ckpt as oc

        tx = make_tx(self.chain)
        params = _place_leaves(host_params, self.param_specs, mesh)
        if self.create == "jit":
            return jax.jit(lambda p: oc.TrainState.create(apply_fn=None, params=p, tx=tx))(params)
        host_state = oc.TrainState.create(apply_fn=None, params=host_params, tx=tx)
        opt_shardings = _shardings(host_state.opt_state, self.opt_specs, mesh)
        if self.create == "jit_out":
            shardings = host_state.replace(params=jax.tree.map(lambda x: x.sharding, params),
                                           opt_state=opt_shardings, step=_replicated(mesh))
            return jax.jit(lambda p: oc.TrainState.create(apply_fn=None, params=p, tx=tx),
                           out_shardings=shardings)(params)
        values = jax.device_get(host_state.opt_state)
        opt_state = jax.tree.map(lambda v, s: _put(np.asarray(v), s), values, opt_shardings)
        return host_state.replace(params=params, opt_state=opt_state, step=_put(np.int32(0), _replicated(mesh)))


def _replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P

    return NamedSharding(mesh, P())


def _spec(spec: Spec):
    from jax.sharding import PartitionSpec as P

    return P(*(tuple(s) if isinstance(s, list) else s for s in spec))


def _shardings(tree: Any, specs: tuple[Spec, ...], mesh) -> Any:
    """A sharding per leaf of ``tree``: the next of ``specs`` for each non-scalar leaf, in
    tree order; scalars replicated."""
    import jax
    from jax.sharding import NamedSharding

    leaves, treedef = jax.tree.flatten(tree)
    specs = iter(specs)
    out = [NamedSharding(mesh, _spec(next(specs))) if np.ndim(x) else _replicated(mesh) for x in leaves]
    return jax.tree.unflatten(treedef, out)


def _put(value: np.ndarray, sharding) -> Any:
    import jax

    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _place_leaves(host: dict, specs: tuple[Spec, ...], mesh) -> dict:
    import jax

    return jax.tree.map(lambda v, s: _put(v, s), host, _shardings(host, specs, mesh))


def leaf_shapes(chain: str) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The shapes of the parameter leaves and of the chain's non-scalar optimizer-state
    leaves, in tree order (what :class:`Case`'s specs are drawn for)."""
    import jax

    params = make_params()
    state = make_tx(chain).init(params)
    return ([tuple(x.shape) for x in jax.tree.leaves(params)],
            [tuple(np.shape(x)) for x in jax.tree.leaves(state) if np.ndim(x)])
