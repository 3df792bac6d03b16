"""The app's own arrangement of the saved tree.

Every door saves ``{"step", "params", "opt_state", **extras}``. An app whose restore code
expects another tree (``{"model": ..., "optimizer": ..., "step": ...}``) passes a function
that rearranges the standard tree; its own code then restores our checkpoints with stock
Orbax, and ours restores them back into the train state.

Why a rearrangement and not any function: restoring needs the inverse. The function is run
once, at ``prepare``, on placeholders instead of arrays; the placeholders it returns say
where each standard leaf went. A function that computes with leaves, drops one, uses one
twice or adds new ones is refused there, with what it did.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from ..doors.base import Parts, standard_tree
from ..errors import ConfigError
from ..hostarray import HostArray

Arrange = Callable[[dict], Any]


class _Placeholder:
    """Stands for standard leaf ``index`` while the app's function runs."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<leaf {self.index}>"


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (HostArray, _Placeholder))


class SaveTree:
    """Maps the standard tree to the app's tree and back, by position."""

    def __init__(self, arrange: Arrange | None = None):
        self.arrange = arrange
        self._standard_def = None
        self._saved_def = None
        self._order: list[int] = []  # saved leaf i is standard leaf _order[i]

    def bind(self, standard: Any) -> None:
        """Learn the arrangement for a standard tree of this structure (at ``prepare``)."""
        leaves, treedef = jax.tree.flatten(standard, is_leaf=_is_leaf)
        if self.arrange is None or (self._standard_def is not None and treedef == self._standard_def):
            self._standard_def = treedef
            return
        placeholders = [_Placeholder(i) for i in range(len(leaves))]
        try:
            arranged = self.arrange(jax.tree.unflatten(treedef, placeholders))
        except Exception as e:  # noqa: BLE001 - the app's function did arithmetic on a leaf
            raise ConfigError(f"save_tree must only rearrange the standard tree (no arithmetic, no "
                              f"new arrays); calling it on placeholders raised {type(e).__name__}: {e}") from e
        saved, saved_def = jax.tree.flatten(arranged, is_leaf=_is_leaf)
        order = [x.index if isinstance(x, _Placeholder) else None for x in saved]
        if None in order or sorted(order) != list(range(len(leaves))):
            extra = [repr(x) for x in saved if not isinstance(x, _Placeholder)][:3]
            missing = sorted(set(range(len(leaves))) - {i for i in order if i is not None})[:3]
            raise ConfigError(
                "save_tree must return every leaf of the standard tree exactly once and nothing else "
                f"(new values: {extra}, missing leaves: {missing}); put constants in the "
                "checkpoint metadata instead.")
        self._standard_def, self._saved_def, self._order = treedef, saved_def, order

    def to_saved(self, standard: Any) -> Any:
        """The standard tree in the app's arrangement."""
        if self.arrange is None:
            return standard
        leaves = jax.tree.leaves(standard, is_leaf=_is_leaf)
        return jax.tree.unflatten(self._saved_def, [leaves[i] for i in self._order])

    def to_standard(self, saved: Any) -> Any:
        """Inverse of :meth:`to_saved` (a restored tree back to the standard one)."""
        if self.arrange is None:
            return saved
        values = jax.tree.leaves(saved, is_leaf=_is_leaf)
        leaves: list[Any] = [None] * len(values)
        for position, value in zip(self._order, values):
            leaves[position] = value
        return jax.tree.unflatten(self._standard_def, leaves)

    # -- a door's parts in and out: the manager's windows, saves and restores ----------------
    def bind_door(self, door: Any, parts: Parts) -> Any:
        """Learn the arrangement of ``door``'s ``parts`` (a state's, a restore target's);
        returns them as saved."""
        plain = door.plain(standard_tree(parts))
        self.bind(plain)
        return self.to_saved(plain)

    def saved(self, door: Any, parts: Parts) -> Any:
        """``parts`` (a window's host copy) as saved, in the arrangement bound last."""
        return self.to_saved(door.plain(standard_tree(parts)))

    def read_parts(self, door: Any, target: Parts, saved: Any) -> Parts:
        """A tree read in the saved arrangement, as ``door``'s parts shaped like ``target``."""
        tree = door.unplain(self.to_standard(saved), standard_tree(target))
        extras = {k: v for k, v in tree.items() if k not in ("params", "opt_state")}
        return Parts(tree["params"], tree["opt_state"], extras, target.tx)
