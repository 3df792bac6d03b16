"""The arguments of one call of a train step, as shapes, dtypes and shardings only.

``CheckpointManager.compile_ahead`` lowers the window variants of the user's step from
these in a background thread: they hold no reference to buffers the next step donates,
and the live objects of an ``nnx.jit`` loop (the model, the optimizer) are never touched
while the training thread mutates them.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from flax.nnx import graphlib


def abstract_array(x: Any) -> Any:
    """``x`` as a ``ShapeDtypeStruct``; an uncommitted array stays unplaced, because jit keys
    its cache on that difference (anything else is returned as it is)."""
    if not isinstance(x, jax.Array):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if x.committed else None,
                                weak_type=getattr(x, "weak_type", False))  # typed PRNG keys have none


def abstract_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with every array abstract. NNX objects (graph nodes) become
    new objects of the same graph, split and merged together so that what they share
    stays shared, holding abstract values."""
    nodes = [i for i, a in enumerate(args) if graphlib.is_graph_node(a)]
    out = [a if i in nodes else jax.tree.map(abstract_array, a) for i, a in enumerate(args)]
    if nodes:
        graphdef, state = nnx.split(tuple(args[i] for i in nodes))
        copies = nnx.merge(graphdef, jax.tree.map(abstract_array, state))
        for i, copy in zip(nodes, copies):
            out[i] = copy
    return tuple(out), jax.tree.map(abstract_array, kwargs)
