"""What each output of a window program is, read from the outbox it returns: which leaf of
the state, which gradient piece, which packed group (:func:`output_labels`).

Why from the outbox rather than from the compiled program: a host copy's operands lead back
to the step's arguments only for a copy of the state. A per-leaf gradient copy reads the
backward pass, whose operand chain may reach a parameter (and was named after it); a
packed copy reads a concatenation behind bitcasts. The outbox says what every one of its
arrays is (the ticket's plan, its item order: :mod:`overlap_ckpt.core.packing`), and
the compiled program keeps the step's outputs in their flattened order, so a copy is named
by the output it lands in (:func:`overlap_ckpt.aot.hlo.host_copies`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import numpy as np

from ..core import packing
from ..core.plan import CapturePlan
from ..core.ticket import Outbox

# HostCopy.kind: what the copy carries.
STATE = "state"  # read from the step's input state: params, optimizer state, extras
GRADIENTS = "gradients"  # this step's gradient pieces (exist after the backward pass)
SCALARS = "scalars"  # the global scalars the host cannot recompute


class OutputLabel(NamedTuple):
    kind: str  # STATE, GRADIENTS, SCALARS; "" for an output that is not in an outbox
    name: str


def output_labels(out_info: Any) -> list[OutputLabel]:
    """One label per leaf of a lowered program's output tree (``lowered.out_info``), in
    flattened order; the leaves outside any :class:`Outbox` get ``OutputLabel("", "")``."""
    labels: list[OutputLabel] = []
    for node in jax.tree.leaves(out_info, is_leaf=lambda x: isinstance(x, Outbox)):
        if isinstance(node, Outbox):
            labels += outbox_labels(node)
        else:
            labels.append(OutputLabel("", ""))
    return labels


def outbox_labels(outbox: Outbox) -> list[OutputLabel]:
    """The labels of an outbox's arrays in its flattened order (its data fields, in order:
    state, shared, grads, globals, extras, packed)."""
    plan, phase, layout = outbox.ticket.plan, outbox.ticket.phase, outbox.packing
    names = _leaf_names(plan)
    with_extras = bool(outbox.extras) or (layout is not None and layout.extras)
    items = packing.phase_items(plan, phase, with_extras)
    parts: dict[str, list[OutputLabel]] = {}
    packed: list[OutputLabel] = []
    for part, entries in items.parts():
        mask = packing.selected(plan, [item for _, item in entries]) if layout is not None else [False] * len(entries)
        parts[part] = [OutputLabel(STATE, _item_name(names, source, item))
                       for (source, item), chosen in zip(entries, mask) if not chosen]
    if layout is not None:
        state = [(source, item) for _, entries in items.parts() for source, item in entries]
        chosen = [(_item_name(names, source, item), item)
                  for (source, item), on in zip(state, packing.selected(plan, [item for _, item in state])) if on]
        packed += _groups(chosen, STATE, "the state")
    grads = packing.grad_items(plan, phase) if outbox.grads or (layout is not None and layout.grads) else ()
    grad_mask = packing.selected(plan, grads) if layout is not None and layout.grads else [False] * len(grads)
    grad_labels = [OutputLabel(GRADIENTS, "gradient of " + _item_name(names, "params", item))
                   for item, chosen in zip(grads, grad_mask) if not chosen]
    if layout is not None and layout.grads:
        packed += _groups([("gradient of " + _item_name(names, "params", item), item)
                           for item, on in zip(grads, grad_mask) if on], GRADIENTS, "gradients")
    expected = {"state": parts["state"], "shared": parts["shared"], "grads": grad_labels,
                "globals": [OutputLabel(SCALARS, "global scalars")] * len(outbox.globals),
                "extras": parts["extras"], "packed": packed}
    labels = []
    for field in ("state", "shared", "grads", "globals", "extras", "packed"):
        arrays, named = jax.tree.leaves(getattr(outbox, field)), expected[field]
        if len(arrays) != len(named):  # not the layout this module knows: say what it is, no more
            named = [OutputLabel(GRADIENTS if field == "grads" else SCALARS if field == "globals" else STATE,
                                 f"outbox.{field}[{n}]") for n in range(len(arrays))]
        labels += named
    return labels


def _groups(entries: Sequence[tuple[str, packing.Item]], kind: str, what: str) -> list[OutputLabel]:
    """One label per packed array of ``entries`` ((name, item) pairs, in packing order:
    :func:`overlap_ckpt.core.packing.groups`): the item's own name for a group of one (its
    copy carries that leaf alone), else what the group packs."""
    labels = []
    for carrier, members in packing.groups([item for _, item in entries]):
        if len(members) == 1:
            labels.append(OutputLabel(kind, entries[members[0]][0]))
        else:
            labels.append(OutputLabel(kind, f"a packed outbox of {what} ({len(members)} items, "
                                            f"{np.dtype(carrier).itemsize * 8}-bit)"))
    return labels


def _item_name(names: dict[str, list[str]], source: str, item: packing.Item) -> str:
    """``params['l0']['w']``, with its rows when the item is a row chunk of the leaf."""
    name = names[source][item.piece.leaf]
    return name if item.is_whole else f"{name} rows {item.piece.start}:{item.piece.stop}"


def _leaf_names(plan: CapturePlan) -> dict[str, list[str]]:
    """Each leaf's path in the saved tree's terms (``params``, ``opt_state``, ``extras``)."""
    def names(prefix: str, treedef: Any, n: int) -> list[str]:
        if treedef is None:
            return [f"{prefix}[{i}]" for i in range(n)]
        tree = jax.tree_util.tree_unflatten(treedef, list(range(n)))
        return [prefix + jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return {"params": names("params", plan.params_def, len(plan.params)),
            "state": names("opt_state", plan.state_def, len(plan.state)),
            "extras": names("extras", plan.extras_def, len(plan.extras))}
