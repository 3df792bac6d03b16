"""The Orbax version matrix: our checkpoints restored by stock Orbax releases, theirs by us.

For each environment of :func:`compat.envs.matrix` (every dependency at its declared floor,
the newest Orbax 0.11, the newest release): stock Orbax in that environment restores a
checkpoint written by :class:`CheckpointStore` three ways (manager, typed, v1 API) bit for
bit, and we restore, bit for bit, what that Orbax writes in each layout it can write
(StandardSave, Composite, OCDBT on/off, zarr3 on/off, the v1 API's save_pytree). The floor environment also runs the
library itself: train, checkpoint, restore (tests/compat/floor_smoke.py).

A venv that cannot be built fails the test in CI (``CI=true``); elsewhere it is skipped
with the reason, so a developer offline still runs the rest of the suite.
"""

from __future__ import annotations

import os
import pickle
import subprocess

import jax
import ml_dtypes
import numpy as np
import pytest

from overlap_ckpt.storage import CheckpointStore

from compat import envs, orbax_side

HERE = os.path.dirname(os.path.abspath(__file__))
MATRIX = envs.matrix()


def matrix_tree():
    """A small train-state-like tree: every dtype a train state holds, a scalar, nesting
    through dicts, lists and tuples, an empty node, and an array over several chunks."""
    rng = np.random.default_rng(7)
    kernel = rng.standard_normal((64, 32), dtype=np.float32)  # 8 KiB: 8 chunks of 1 KiB
    return {
        "step": np.int32(1234),
        "params": {"dense": {"kernel": kernel, "bias": rng.standard_normal(32).astype(ml_dtypes.bfloat16)},
                   "norm": {"scale": rng.standard_normal((3, 2)).astype(np.float16)}},
        "opt_state": [{"count": np.int32(9), "mu": {"kernel": -kernel}, "nu": {"kernel": kernel * kernel}}, None],
        "extras": ({"mask": np.array([True, False, True]), "bytes": np.arange(9, dtype=np.uint8)},
                   np.int8([-3, 4, 127])),
    }


def python_of(env: envs.OrbaxEnv) -> str:
    try:
        return env.python()
    except envs.EnvBuildError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the version matrix needs the {env.name} venv: {e}")
        pytest.skip(f"{env.name} venv not available here: {e}")


def run(python: str, script: str, *args: str, env: dict | None = None) -> None:
    done = subprocess.run([python, os.path.join(HERE, script), *args], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stderr[-4000:]}"


def orbax_read(python: str, directory, tree, tmp_path) -> dict:
    """What stock Orbax in ``python``'s environment restores from ``directory``."""
    with open(tmp_path / "tree.pkl", "wb") as f:
        pickle.dump(tree, f)
    run(python, "orbax_side.py", "read", "--tree", str(tmp_path / "tree.pkl"), "--dir", str(directory),
        "--out", str(tmp_path / "read.pkl"))
    with open(tmp_path / "read.pkl", "rb") as f:
        return pickle.load(f)


def assert_read_bitwise(read: dict, trees: dict, env: envs.OrbaxEnv) -> None:
    """Every way Orbax restored every step gave exactly ``trees[step]``."""
    assert read["version"] == env.orbax_version, f"the {env.name} environment runs Orbax {read['version']}"
    for way in ("restore", "typed", "v1"):  # every release of the matrix has a v1 API
        assert sorted(read[way]) == sorted(trees), f"Orbax {read['version']} {way}: steps {sorted(read[way])}"
        for step, tree in trees.items():
            want, got = orbax_side.flat(tree), read[way][step]
            assert got.keys() == want.keys(), f"Orbax {read['version']} {way} step {step}: leaves differ"
            for path in want:
                assert got[path] == want[path], f"Orbax {read['version']} {way} step {step}: {path} differs"


@pytest.mark.parametrize("env", MATRIX, ids=[e.name for e in MATRIX])
def test_stock_orbax_restores_our_checkpoints(env, tmp_path):
    trees = {3: matrix_tree(), 5: jax.tree.map(lambda x: x + 1 if x.dtype != bool else ~x, matrix_tree())}
    with CheckpointStore(tmp_path / "ours", chunk_bytes=1024) as store:
        for step, tree in trees.items():
            store.save(step, tree, {"data_position": step})
        store.wait_until_finished()
    read = orbax_read(python_of(env), tmp_path / "ours", trees[3], tmp_path)
    assert_read_bitwise(read, trees, env)
    assert read["custom_metadata"] == {step: {"data_position": step} for step in trees}


@pytest.mark.parametrize("env", MATRIX, ids=[e.name for e in MATRIX])
def test_we_restore_what_stock_orbax_writes(env, tmp_path):
    tree = matrix_tree()
    with open(tmp_path / "tree.pkl", "wb") as f:
        pickle.dump(tree, f)
    run(python_of(env), "orbax_side.py", "write", "--tree", str(tmp_path / "tree.pkl"), "--root", str(tmp_path))
    want = orbax_side.flat(tree)
    abstract = orbax_side.abstract(tree)
    for name in [*orbax_side.WRITERS, "v1"]:
        with CheckpointStore(tmp_path / name, read_only=True) as store:
            assert store.all_steps() == [1], name
            untyped, _ = store.restore(1)
            typed, _ = store.restore(1, abstract)
        assert orbax_side.flat(untyped) == want, f"{name} written by Orbax {env.orbax_version}, untyped"
        assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(typed)), name
        assert orbax_side.flat(typed) == want, f"{name} written by Orbax {env.orbax_version}, typed"


def test_library_at_dependency_floors(tmp_path):
    """In the floor venv: train, checkpoint and restore bitwise with the library itself
    (Linen and NNX), then that environment's Orbax reads every step as the library does."""
    (floor,) = [e for e in MATRIX if e.name == "floor"]
    python = python_of(floor)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(envs.REPO), os.environ.get("PYTHONPATH", "")]))
    run(python, "floor_smoke.py", "--dir", str(tmp_path / "ck"), "--out", str(tmp_path / "smoke.pkl"), env=env)
    with open(tmp_path / "smoke.pkl", "rb") as f:
        smoke = pickle.load(f)
    for package, version in floor.pins:
        assert smoke["versions"][package] == version, f"the floor venv runs {package} {smoke['versions'][package]}"
    assert sorted(smoke["steps"]) == ["linen", "nnx"]
    for style, trees in smoke["steps"].items():
        assert sorted(trees) == [4, 8], style
        read = orbax_read(python, tmp_path / "ck" / style, trees[8], tmp_path)
        assert_read_bitwise(read, trees, floor)
