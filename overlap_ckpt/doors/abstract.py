"""The arguments of one call of a train step, as shapes, dtypes and shardings only.

``CheckpointManager.compile_ahead`` lowers the window variants of the user's step from
these in a background thread: they hold no reference to buffers the next step donates,
and the live objects of an ``nnx.jit`` loop (the model, the optimizer) are never touched
while the training thread mutates them.
"""

from __future__ import annotations

from typing import Any

import jax

from .base import imported_nnx


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
    nodes = [i for i, a in enumerate(args) if is_graph_node(a)]
    out = [a if i in nodes else jax.tree.map(abstract_array, a) for i, a in enumerate(args)]
    if nodes:
        nnx = imported_nnx()
        graphdef, state = nnx.split(tuple(args[i] for i in nodes))
        copies = nnx.merge(graphdef, jax.tree.map(abstract_array, state))
        for i, copy in zip(nodes, copies):
            out[i] = copy
    return tuple(out), jax.tree.map(abstract_array, kwargs)


def graph_nodes(args: tuple) -> dict[int, Any]:
    """The NNX objects among ``args``, by position."""
    return {i: a for i, a in enumerate(args) if is_graph_node(a)}


def is_graph_node(x: Any) -> bool:
    """Whether ``x`` is an NNX object (without importing NNX, see :func:`imported_nnx`)."""
    nnx = imported_nnx()
    return nnx is not None and nnx.graphlib.is_graph_node(x)


def after_the_step(abstract_args: tuple, nodes: dict[int, Any], states: list[int], state: Any) -> tuple:
    """``abstract_args`` (of a call before the first step) as the call is after it: the
    state at ``states`` as the step returned it, and the NNX objects ``nodes`` (live, updated
    in place by the step) as they hold now.

    Why: a ``jit`` without ``out_shardings`` places its outputs where XLA chose (a replicated
    bias comes back sharded), so every later call sees other input shardings than the
    first; window variants compiled for the first call's would compile again at the first
    window, on the training thread."""
    out = list(abstract_args)
    for i in states:
        if i not in nodes:
            out[i] = jax.tree.map(abstract_array, state)
    if nodes:
        copies, _ = abstract_arguments(tuple(nodes.values()), {})
        for i, copy in zip(nodes, copies):
            out[i] = copy
    return tuple(out)
