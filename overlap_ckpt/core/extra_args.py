"""Extra arguments to an optax update (``tx.update(..., value=loss)``): accepted when they
change nothing, refused by name when they do.

Why this check exists: the host replays ``tx.update(grads, opt_state, params)`` and has no
copy of anything else the step passed, so a window step runs the update without the extra
arguments. That is the user's own step only if the arguments do not change the update.
optax's chains hand an extra argument to the transformations that declare it and drop it
for the others, so ``adamw`` given ``value=loss`` computes exactly what it computes
without it, and the window may drop it. A transformation that needs the argument
(``optax.contrib.reduce_on_plateau``) fails without it, which ``prepare`` already refuses;
one that uses it only when given must be refused where the argument first shows up,
at the first step that passes it, before any window.

"Changes nothing" is decided on the traced programs, not on names: the arguments are
inputs of the update's jaxpr that no equation and no output reads, and the update traced
with them runs the same primitives as the update traced without them (a transformation
that branches in Python on ``value is None`` is caught by the second test).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
import optax

from ..errors import UnsupportedOptimizerError


def check_extra_update_args(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                            extra_args: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedOptimizerError` if ``extra_args`` change what
    ``tx.update(grads, opt_state, params, **extra_args)`` computes.

    Works on tracers too (call it while the step is traced): only shapes and dtypes are
    read. An update that fails with the arguments fails here as it would in the step.
    """
    if not extra_args:
        return
    leaves, treedef = jax.tree.flatten(dict(extra_args))
    traced = [i for i, leaf in enumerate(leaves) if _is_array_like(leaf)]

    def with_args(arrays, g, s, p):
        full = list(leaves)
        for i, array in zip(traced, arrays):
            full[i] = array
        return tx.update(g, s, p, **jax.tree.unflatten(treedef, full))

    def without_args(g, s, p):
        return tx.update(g, s, p)

    args = (grads, opt_state, params)  # make_jaxpr reads only their shapes and dtypes
    given = jax.make_jaxpr(with_args)([leaves[i] for i in traced], *args)
    try:
        plain = jax.make_jaxpr(without_args)(*args)
    except Exception as e:  # noqa: BLE001 - an update that needs them (prepare refuses it too)
        raise _refusal(extra_args) from e
    extra_vars = {id(v) for v in given.jaxpr.invars[:len(traced)]}
    read = any(id(v) in extra_vars for eqn in given.jaxpr.eqns for v in eqn.invars) or any(
        id(v) in extra_vars for v in given.jaxpr.outvars)
    same_program = ([eqn.primitive for eqn in given.jaxpr.eqns] == [eqn.primitive for eqn in plain.jaxpr.eqns]
                    and given.out_avals == plain.out_avals)
    if read or not same_program:
        raise _refusal(extra_args)


def _refusal(extra_args: Mapping[str, Any]) -> UnsupportedOptimizerError:
    return UnsupportedOptimizerError(
        f"the optimizer's update uses the extra argument(s) {', '.join(sorted(extra_args))} "
        "passed to update(): overlap_ckpt replays tx.update(grads, opt_state, params) on the "
        "host without them, so its checkpoints would not be the state of their step. Stop "
        "passing them (the chains of docs/optimizers.md do not read them), use an optimizer "
        "that does not read them, or checkpoint this training with orbax.checkpoint directly.")


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))
