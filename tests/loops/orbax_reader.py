"""Read a checkpoint directory with stock Orbax only (no overlap_ckpt in this process).

``python tests/loops/orbax_reader.py --dir D --out F.pkl [--app-layout]`` pickles
``{"restore": {step: {path: ndarray}}, "app": {step: {path: ndarray}}}``:

* ``restore``: ``orbax.checkpoint.CheckpointManager(D).restore(step)``, no arguments (an
  item other than ``"default"`` comes back as a ``Composite`` of that one item);
* ``app`` (``--app-layout``): the app's own restore code: an abstract tree in the app's
  layout ``{"model", "optimizer", "step"}`` built from its model and optimizer, read with
  ``ocp.args.Composite(state=ocp.args.StandardRestore(abstract))``.

Paths are tuples of key strings (dict keys, sequence indices, attribute names).
"""

from __future__ import annotations

import argparse
import pickle
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


def flat(tree) -> dict[tuple, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        out[key] = np.asarray(leaf)
    return out


def app_abstract_tree():
    """What the app's restore code would build: its model's params and optimizer state."""
    import loop_models as M

    params = M.app_model().init(jax.random.key(0), np.ones((1, M.FEATURES), np.float32))["params"]
    tree = {"model": params, "optimizer": M.app_tx().init(params), "step": jnp.int32(0)}
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--app-layout", action="store_true")
    args = p.parse_args(argv)
    result = {"restore": {}, "app": {}}
    with ocp.CheckpointManager(args.dir) as mngr:
        steps = mngr.all_steps()
        for step in steps:
            tree = mngr.restore(step)
            if isinstance(tree, ocp.args.Composite):  # an item not named "default"
                (name,) = tree.keys()
                tree = tree[name]
            result["restore"][step] = flat(tree)
            if args.app_layout:
                restored = mngr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(app_abstract_tree())))
                result["app"][step] = flat(restored["state"])
    leaked = sorted(m for m in sys.modules if m.split(".")[0] == "overlap_ckpt")
    assert not leaked, f"stock Orbax reader imported {leaked}"
    with open(args.out, "wb") as f:
        pickle.dump({"steps": steps, **result}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
