"""Every training-loop style, SIGKILLed in the middle of a checkpoint window and resumed.

For each style of ``worker.py`` (one subprocess each, a JAX compilation cache shared by
the subprocesses of a style):

1. a reference run trains 18 steps uninterrupted, checkpointing every 4 steps with
   windows of 2 steps (the same schedule as every other run: window steps may round
   differently from a loop without checkpoints, by design);
2. a second run into a fresh directory waits for the checkpoints of 4 and 8, runs phase 0
   of the window of 12 (step 11) and SIGKILLs itself;
3. a third run resumes from that directory with ``mngr.restore(target_state=...)`` and
   trains to 18.

Checked: the resumed run starts at a committed step (8), trains through the windows of 12
and 16 and its losses equal the reference bitwise from the resumed step on; every step in
the directory reads the same with stock Orbax (a process without overlap_ckpt:
``orbax.checkpoint.CheckpointManager(dir).restore(step)``) as with
``overlap_ckpt.CheckpointManager(dir).restore(step)``, and equals the reference run's
checkpoint of that step. The app-layout style's own restore code (stock Orbax with its
abstract tree) reads the same arrays too.

The styles' chains run two at a time (the machine has 2 cores): a test starts its own
style's chain and the one of the test its process runs next. So a process runs only the
styles of its own tests: under pytest-xdist, each worker runs its share of the styles.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STYLES = ["linen_fsdp", "linen_pmap", "linen_pmap_broadcast", "explicit_mesh", "nnx_jit", "nnx_functional", "nnx_lm_jit",
          "nnx_lm_state_update", "trainstate_fields", "app_layout", "shard_map"]
DEVICES = {"linen_fsdp": 2, "linen_pmap": 2, "linen_pmap_broadcast": 2, "explicit_mesh": 2, "shard_map": 2}  # others: 1
STEPS, WINDOW = 18, 2
KILL_VERSION = 12  # the third window; its phase 0 runs at step 11
PARALLEL = 2
TIMEOUT = 240


def _env(style: str, cache: str) -> dict:
    env = dict(os.environ)
    env.update({
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES.get(style, 1)}",
        "PYTHONPATH": REPO + os.pathsep + env.get("PYTHONPATH", ""),
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    })
    return env


def _run(cmd: list[str], env: dict) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, *cmd], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    events = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return {"rc": proc.returncode, "events": events, "stderr": proc.stderr, "seconds": time.monotonic() - t0,
            "cmd": " ".join(cmd)}


def _committed(directory: str) -> list[int]:
    """Committed steps, as overlap_ckpt's read-only manager lists them."""
    import overlap_ckpt

    if not os.path.isdir(directory):
        return []
    with overlap_ckpt.CheckpointManager(directory) as mngr:
        return mngr.all_steps()


def _chain(style: str, base: str) -> dict:
    """Reference, kill, resume and the stock Orbax read of one style, in order."""
    # The run's cache (tests/conftest.py) where there is one: the programs of one style are
    # the same in each run, and in the next run where the cache is kept.
    env = _env(style, os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(base, "jax_cache"))
    worker = os.path.join(HERE, "worker.py")
    ref_dir, run_dir = os.path.join(base, "reference"), os.path.join(base, "run")
    out = {"ref_dir": ref_dir, "run_dir": run_dir}
    t0 = time.monotonic()
    out["reference"] = _run([worker, "--style", style, "--dir", ref_dir, "--steps", str(STEPS)], env)
    if out["reference"]["rc"] == 0:
        out["killed"] = _run([worker, "--style", style, "--dir", run_dir, "--steps", str(STEPS), "--kill"],
                             env)
        out["committed_at_kill"] = _committed(run_dir)
        if out["killed"]["rc"] == -signal.SIGKILL:
            out["resumed"] = _run([worker, "--style", style, "--dir", run_dir, "--steps", str(STEPS),
                                   "--resume"], env)
            if out["resumed"]["rc"] == 0:
                pkl = os.path.join(base, "orbax.pkl")
                cmd = [os.path.join(HERE, "orbax_reader.py"), "--dir", run_dir, "--out", pkl]
                out["orbax"] = _run(cmd + (["--app-layout"] if style == "app_layout" else []), env)
                if out["orbax"]["rc"] == 0:
                    with open(pkl, "rb") as f:
                        out["orbax_trees"] = pickle.load(f)
    out["seconds"] = time.monotonic() - t0
    return out


class Chains:
    """Each style's chain, started once (two at a time) when a test asks for it."""

    def __init__(self, base: str):
        self._base = base
        self._pool = ThreadPoolExecutor(PARALLEL)
        self._started: dict[str, Future] = {}

    def start(self, style: str) -> Future:
        if style not in self._started:
            self._started[style] = self._pool.submit(_chain, style, os.path.join(self._base, style))
        return self._started[style]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    runner = Chains(str(tmp_path_factory.mktemp("loops")))
    yield runner
    runner.close()


def _start_next(chains: Chains, following, module) -> None:
    """Start the chain of the test this process runs next, if it is one of this module's."""
    if following is not None and getattr(following, "module", None) is module:
        chains.start(following.callspec.params["style"])


def _flat(tree) -> dict[tuple, np.ndarray]:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        out[key] = np.asarray(leaf)
    return out


def _overlap_read(directory: str, step: int) -> dict[tuple, np.ndarray]:
    """``overlap_ckpt.CheckpointManager(dir).restore(step)``: read-only, no target: numpy."""
    import jax

    import overlap_ckpt

    with overlap_ckpt.CheckpointManager(directory) as mngr:
        tree = mngr.restore(step)
    leaves = jax.tree.leaves(tree)
    assert leaves and all(isinstance(v, np.ndarray) for v in leaves), "restore without a target returns numpy"
    return _flat(tree)


def _same_bits(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: leaves differ: {sorted(set(got) ^ set(want))}"
    for key in sorted(want):
        a, b = got[key], want[key]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (what, key, a.dtype, a.shape, b.dtype, b.shape)
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), \
            f"{what} {key}: values differ"


def _ok(run: dict | None, what: str, rc: int = 0) -> None:
    assert run is not None, f"{what} did not run"
    assert run["rc"] == rc, (f"{what} exited with {run['rc']} (expected {rc}); "
                             f"python {run['cmd']}\n{run['stderr'][-4000:]}")


def _losses(run: dict) -> dict[int, int]:
    return {e["t"]: e["loss"] for e in run["events"] if e["ev"] == "step"}


@pytest.mark.parametrize("style", STYLES)
def test_sigkill_mid_window_then_resume(chains, style, next_item, request):
    mine = chains.start(style)
    _start_next(chains, next_item, request.module)
    r = mine.result()
    print(f"{style}: {r['seconds']:.1f}s " + ", ".join(
        f"{k} {r[k]['seconds']:.1f}s" for k in ("reference", "killed", "resumed", "orbax") if k in r))

    # 1. The reference: 18 steps, every window's checkpoint committed.
    _ok(r["reference"], f"{style} reference run")
    reference = _losses(r["reference"])
    assert sorted(reference) == list(range(STEPS))
    assert _committed(r["ref_dir"]) == [4, 8, 12, 16]

    # 2. Killed right after phase 0 of the third window, with two checkpoints committed.
    _ok(r.get("killed"), f"{style} run killed mid-window", rc=-signal.SIGKILL)
    events = r["killed"]["events"]
    settled = [e for e in events if e["ev"] == "settled"]
    assert settled and settled[0]["steps"] == [4, 8], settled
    steps = [e for e in events if e["ev"] == "step"]
    assert (steps[-1]["t"], steps[-1]["phase"]) == (KILL_VERSION - WINDOW + 1, 0), steps[-1]
    assert all(e["loss"] == reference[e["t"]] for e in steps), "the killed run diverged before the kill"
    assert r["committed_at_kill"] == [4, 8], r["committed_at_kill"]  # the window of 12 never completed

    # 3. Resumed from a committed step, through two more windows, bitwise the reference.
    _ok(r.get("resumed"), f"{style} resumed run")
    restored = [e for e in r["resumed"]["events"] if e["ev"] == "restored"]  # Linen styles report it
    assert len(restored) == (0 if style.startswith("nnx") else 1), restored
    assert all(e["mismatches"] == [] for e in restored), "not restored into the target's shardings: " + \
        "; ".join(m for e in restored for m in e["mismatches"])
    resumed = _losses(r["resumed"])
    start = min(resumed)
    assert start == 8 and start in r["committed_at_kill"], (start, r["committed_at_kill"])
    assert sorted(resumed) == list(range(start, STEPS))
    windows = {(e["t"], e["phase"]) for e in r["resumed"]["events"]
               if e["ev"] == "step" and e["phase"] is not None}
    assert {(11, 0), (12, 1), (15, 0), (16, 1)} <= windows, sorted(windows)
    wrong = [t for t in range(start, STEPS) if resumed[t] != reference[t]]
    assert not wrong, f"resumed losses differ from the uninterrupted run at steps {wrong}"
    assert _committed(r["run_dir"]) == [4, 8, 12, 16]

    # 4. Stock Orbax reads what overlap_ckpt reads; every checkpoint equals the reference's.
    _ok(r.get("orbax"), f"{style} stock Orbax reader")
    stock = r["orbax_trees"]
    assert stock["steps"] == [4, 8, 12, 16], stock["steps"]
    ours = {step: _overlap_read(r["run_dir"], step) for step in stock["steps"]}
    for step in stock["steps"]:
        _same_bits(stock["restore"][step], ours[step], f"{style} step {step}: stock Orbax vs overlap_ckpt")
        if style == "app_layout":
            assert sorted({k[0] for k in ours[step]}) == ["model", "optimizer", "step"], sorted(ours[step])
            _same_bits(stock["app"][step], ours[step], f"{style} step {step}: the app's own Orbax restore")
    # The resumed run's checkpoints (12, 16) are the uninterrupted run's, bit for bit: the
    # checkpoint it resumed from was the exact device state, not a close one.
    for step in stock["steps"]:
        _same_bits(ours[step], _overlap_read(r["ref_dir"], step),
                   f"{style} step {step}: resumed run's directory vs the reference's")
