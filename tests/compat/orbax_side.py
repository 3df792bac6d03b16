"""The stock-Orbax side of the version matrix: runs in a venv holding one Orbax release.

It imports Orbax, JAX and NumPy only, never ``overlap_ckpt``, so what it reads or writes is
what a user pinned to that Orbax gets. It neither knows nor checks the expected values:
it pickles what Orbax gave back, and the test (in the main environment) compares bits.

``python orbax_side.py read --dir ROOT --tree TREE.pkl --out OUT.pkl``
    restores every step of ``ROOT`` three ways: ``CheckpointManager(ROOT).restore(step)``
    with no arguments (the handler comes from ``_CHECKPOINT_METADATA``), a typed restore
    of the item directory onto ``jax.Array`` targets built from ``TREE.pkl``'s shapes and
    dtypes, and ``orbax.checkpoint.v1.load_pytree`` where the release has a v1 API; and
    each step's ``custom_metadata`` (the ``metadata`` dict given to our ``save``).

``python orbax_side.py write --tree TREE.pkl --root ROOT``
    writes ``TREE.pkl`` at step 1 with ``CheckpointManager`` once per :data:`WRITERS` entry,
    each under ``ROOT/<name>``, and with the v1 API's ``save_pytree`` under ``ROOT/v1``.

Trees are nested dicts/lists of numpy arrays (``None`` for empty nodes), pickled.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

# name -> (item name or None for the default item, use_ocdbt, use_zarr3). None means
# StandardSave (the layout CheckpointStore writes); a bool pair means PyTreeSave with those
# storage options, to cover every combination Orbax can leave on disk.
WRITERS = {
    "standard": (None, None),
    "composite": ("state", None),
    "ocdbt_zarr2": (None, (True, False)),
    "noocdbt_zarr3": (None, (False, True)),
    "noocdbt_zarr2": (None, (False, False)),
}


def flat(tree) -> dict[str, tuple]:
    """``{key path: (shape, dtype name, raw bytes)}``: what bitwise equality compares."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = np.asarray(leaf)
        out[jax.tree_util.keystr(path)] = (x.shape, x.dtype.name, x.tobytes())
    return out


def abstract(tree):
    """``jax.ShapeDtypeStruct`` targets on the first device, as a user's restore builds them."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding), tree)


def v1_api():
    """The v1 API module of this release (``orbax.checkpoint.v1``, earlier
    ``orbax.checkpoint.experimental.v1``), or None where it has none."""
    for name in ("orbax.checkpoint.v1", "orbax.checkpoint.experimental.v1"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def read(root: str, tree) -> dict:
    result = {"version": ocp.__version__, "restore": {}, "typed": {}, "v1": {}, "custom_metadata": {}}
    v1 = v1_api()
    with ocp.CheckpointManager(root) as mngr:
        for step in mngr.all_steps():
            restored, item = mngr.restore(step), "default"
            if isinstance(restored, ocp.args.Composite):  # an item not named "default"
                (item,) = restored.keys()
                restored = restored[item]
            result["restore"][step] = flat(restored)
            result["custom_metadata"][step] = mngr.metadata(step).custom_metadata
            typed = ocp.StandardCheckpointer().restore(f"{root}/{step}/{item}", abstract(tree))
            assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(typed)), "typed restore gave non-arrays"
            result["typed"][step] = flat(typed)
            if v1 is not None:
                result["v1"][step] = flat(v1.load_pytree(f"{root}/{step}", checkpointable_name=item))
    return result


def write(root: str, tree) -> None:
    jtree = jax.tree.map(jax.numpy.asarray, tree)
    for name, (item, storage) in WRITERS.items():
        directory = f"{root}/{name}"
        if storage is None:
            args = ocp.args.StandardSave(jtree)
            handlers = None
        else:
            use_ocdbt, use_zarr3 = storage
            args = ocp.args.PyTreeSave(jtree)
            handlers = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
        with ocp.CheckpointManager(directory, item_handlers=handlers if item is None else None) as mngr:
            mngr.save(1, args=args if item is None else ocp.args.Composite(**{item: args}))
            mngr.wait_until_finished()
    v1 = v1_api()
    if v1 is not None:
        v1.save_pytree(f"{root}/v1/1", jtree)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("read", "write"))
    parser.add_argument("--tree", required=True)
    parser.add_argument("--dir")
    parser.add_argument("--out")
    parser.add_argument("--root")
    args = parser.parse_args(argv)
    with open(args.tree, "rb") as f:
        tree = pickle.load(f)
    if args.mode == "read":
        with open(args.out, "wb") as f:
            pickle.dump(read(args.dir, tree), f)
    else:
        write(args.root, tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
