"""SIGKILL of a writing process at every persist stage.

Each child saves step 1, installs a fault hook that SIGKILLs itself at one stage of the
persist of step 2, and saves step 2. The parent then checks that step 1 is intact, that
step 2 is either fully committed (kill after the commit) or invisible and reported as
incomplete, that the dead child's lock is taken over, and that the next save cleans up.
All children run concurrently (forked from one driver) to keep the suite fast.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import orbax.checkpoint as ocp
import pytest

from overlap_ckpt.storage import FAULT_STAGES, CheckpointStore, IncompleteCheckpointError

from conftest import REPO


# One driver process imports the library once, then forks one child per stage (importing
# jax in seven processes would dominate the suite's time on a 2-core machine). The children
# only use numpy and TensorStore, which are safe to fork before first use; jax's backend is
# never initialized in them.
DRIVER = textwrap.dedent(r"""
    import json, os, signal, sys
    import numpy as np
    from overlap_ckpt.storage import CheckpointStore, set_fault_hook

    base, stages = sys.argv[1], sys.argv[2:]

    def tree(step):
        return {"v": np.arange(5000, dtype=np.int32) + step, "w": np.full((64, 64), step, np.float32)}

    def scenario(root, stage):
        # Tiny chunks and batches: several OCDBT commits happen before the kill.
        store = CheckpointStore(root, max_to_keep=1 if stage == "retention" else None,
                                chunk_bytes=4096, max_inflight_bytes=1)
        store.save(1, tree(1))
        store.wait_until_finished()

        def hook(st, info):
            if st == stage and info["step"] == 2 and info.get("array", "w") == "w":
                os.kill(os.getpid(), signal.SIGKILL)

        set_fault_hook(hook)
        store.save(2, tree(2))
        store.wait_until_finished()
        print("NOT KILLED", stage, flush=True)

    pids = {}
    for stage in stages:
        pid = os.fork()
        if pid == 0:
            try:
                scenario(os.path.join(base, stage), stage)
            finally:
                os._exit(3)
        pids[pid] = stage
    codes = {}
    while pids:
        pid, status = os.wait()
        codes[pids.pop(pid)] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(json.dumps(codes))
""")

STAGES = list(FAULT_STAGES)


def expected_tree(step):
    return {"v": np.arange(5000, dtype=np.int32) + step, "w": np.full((64, 64), step, np.float32)}


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    base = tmp_path_factory.mktemp("crash")
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(base), *STAGES], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return {stage: (base / stage, codes[stage], proc.stdout + proc.stderr) for stage in STAGES}


@pytest.mark.parametrize("stage", STAGES)
def test_kill_at_stage(killed_runs, stage):
    root, code, output = killed_runs[stage]
    assert code == -signal.SIGKILL, output
    committed = stage in ("committed", "retention")
    with CheckpointStore(root) as store:  # the dead child's lock is taken over
        expected_steps = {"committed": [1, 2], "retention": [2]}.get(stage, [1])
        assert store.all_steps() == expected_steps
        assert store.latest_step() == expected_steps[-1]
        if not committed and stage != "start":
            assert store.incomplete_steps() == [2]
            with pytest.raises(IncompleteCheckpointError, match="partial"):
                store.restore(2)
        for step in expected_steps:
            tree, _ = store.restore(step)
            for key, want in expected_tree(step).items():
                assert tree[key].tobytes() == want.tobytes()
        # Stock Orbax sees the same complete steps (it also ignores *.orbax-checkpoint-tmp).
        orbax_manager = ocp.CheckpointManager(str(root))
        assert orbax_manager.all_steps() == expected_steps
        orbax_manager.close()

        # The next successful save removes the partial leftovers, never a committed step.
        store.save(3, expected_tree(3))
        store.wait_until_finished()
        assert store.incomplete_steps() == []
        assert store.all_steps() == expected_steps + [3]
        assert not [n for n in os.listdir(root) if "tmp" in n]
        assert store.verify().ok
