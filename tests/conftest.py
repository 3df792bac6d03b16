"""Shared test helpers: a donating training loop driven by the engine, and exact comparisons."""

import fcntl
import functools
import itertools
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, TypeVar

# The suite's expectations (bitwise replays, simulated devices) are the CPU backend's. An
# installed accelerator plugin (libtpu from the "aot" extra, which compiles for TPU targets
# without a chip) would otherwise try to claim a device in this process and its subprocesses.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from overlap_ckpt import HostArray, MemorySink, OverlapEngine, capture_update

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: JAX's persistent compilation cache, as the environment of a subprocess sets it.
COMPILE_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                      "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")

#: A compilation cache directory kept between runs (``.ci/run`` sets it); unset, each run
#: starts with an empty cache of its own.
KEPT_COMPILE_CACHE_VAR = "OVERLAP_CKPT_TEST_COMPILE_CACHE"

T = TypeVar("T")


def run_wide_tmp(tmp_path_factory) -> Path:
    """The temporary directory every pytest-xdist worker of this run sees (pytest's own
    base directory without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory, name: str, build: Callable[[Path], T]) -> T:
    """``build(directory)``, run by the first worker that asks for ``name``; every other
    worker waits for it and gets the same (unpickled) result and the same files.

    Why: a module-scoped fixture runs once in each xdist worker that runs one of the
    module's tests, and work stealing splits modules between the two workers, so the
    fixtures that train in subprocesses (a demo, a dozen killed runs: 7-30 s each) were
    run twice in one CI run, on CI's two cores. The build runs under a file lock in the
    run-wide temporary directory, and its result is kept beside its files. Tests that
    change those files work on a copy of them. A build that fails records nothing: a
    worker that asks later builds again and fails on its own."""
    directory = run_wide_tmp(tmp_path_factory) / f"once-{name}"
    result_file = directory.with_name(directory.name + ".pkl")
    with open(directory.with_name(directory.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if result_file.exists():
            with open(result_file, "rb") as f:
                return pickle.load(f)
        if directory.exists():
            shutil.rmtree(directory)  # a failed build's leftovers
        directory.mkdir()
        result = build(directory)
        partial = result_file.with_suffix(".tmp")
        with open(partial, "wb") as f:
            pickle.dump(result, f)
        os.replace(partial, result_file)  # whole or absent, for a worker that reads it
        return result


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """One JAX compilation cache for the whole run: both xdist workers and every subprocess.

    Why: CI's time is mostly XLA:CPU compiling the same programs again and again (the same
    LM step for each window size, each loop style's reference, killed and resumed runs).
    A program read back from the cache is the one a compile would give, so results,
    bitwise checks included, are the same; compile events still fire (on a hit, too), so
    the tests that check which thread compiled still see every compile. The cache starts
    empty in each run, unless :data:`KEPT_COMPILE_CACHE_VAR` names a directory kept between
    runs (``.ci/run`` keeps one per jax version: its key holds the program, the compile
    options and jax's version, so an entry is never another program's, and a run after a
    change compiles only what the change touched). The compile-only accelerator tests,
    which read the compiler's dumps, turn it off (``tests/aot/conftest.py``), as does
    ``overlap-ckpt aot``. A worker killed while it writes an entry leaves a truncated
    file, which JAX reports with a warning and compiles again. The processes of a
    multi-process job other than process 0 write their own entries only through
    ``tests/e2e/mp_compile_cache.py`` (JAX writes from process 0 alone)."""
    from jax.experimental.compilation_cache import compilation_cache

    kept = os.environ.get(KEPT_COMPILE_CACHE_VAR)
    shared = Path(kept) if kept else run_wide_tmp(tmp_path_factory) / "jax-compile-cache"
    os.environ.update(zip(COMPILE_CACHE_VARS, (str(shared), "0", "-1")))
    jax.config.update("jax_compilation_cache_dir", str(shared))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    compilation_cache.reset_cache()  # a compile at collection time has already decided "off"
    yield
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    for name in COMPILE_CACHE_VARS:
        os.environ.pop(name, None)


def bits(x) -> np.ndarray:
    """The raw bytes of an array, so NaNs and signed zeros compare exactly."""
    return np.atleast_1d(np.ascontiguousarray(np.asarray(x))).view(np.uint8)


def assert_bitwise(got_tree, want_tree, what=""):
    got = jax.tree.leaves(got_tree, is_leaf=lambda x: isinstance(x, HostArray))
    want = jax.tree.leaves(want_tree)
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        a = a.to_numpy() if isinstance(a, HostArray) else np.asarray(a)
        b = np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i, a.shape, b.shape, a.dtype, b.dtype)
        if not np.array_equal(bits(a), bits(b)):
            diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))
            raise AssertionError(f"{what}: leaf {i} {a.shape}/{a.dtype} differs (max abs diff {diff})")


EPS32 = float(np.finfo(np.float32).eps)
ULP_BOUND = 4  # ulps at each leaf's largest magnitude (docs/design.md, docs/optimizers.md)


def assert_within_ulps(got_tree, want_tree, what=""):
    """Host replay vs device where they round differently (GPU, or a barrier XLA:CPU drops)."""
    got = jax.tree.leaves(got_tree, is_leaf=lambda x: isinstance(x, HostArray))
    want = jax.tree.leaves(want_tree)
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a.to_numpy() if isinstance(a, HostArray) else a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (what, i)
        if not np.issubdtype(a.dtype, np.floating):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: leaf {i}")
            continue
        scale = max(float(np.max(np.abs(b))), np.finfo(b.dtype).tiny)
        err = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        assert err <= ULP_BOUND * EPS32 * scale, f"{what}: leaf {i} off by {err / (EPS32 * scale):.1f} ulp"


def step_copies(shares, g):
    """What each window step copies, as fractions of the state, for slices of ``shares`` and
    a gradient of ``g`` times the state: slice j and the gradient rows of slices 0..j, then
    the last slice alone (core.capture's outboxes). The reference the slicing and the cost
    model are tested against. Prefix sums, not a sum per step: the cost-model tests ask for
    windows of up to 10**5 steps, where summing each prefix again took a minute of CI."""
    prefix = list(itertools.accumulate(shares))
    return [x + (g * prefix[j] if j < len(shares) - 1 else 0.0) for j, x in enumerate(shares)]


def make_params(shapes, dtype=jnp.float32, seed=0):
    """Random parameters made with numpy: one jax.random call per shape would compile
    a program per distinct shape, which dominates the time of a many-leaf test."""
    rng = np.random.default_rng(seed)
    return {f"w{i:03d}": jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(dtype)
            for i, s in enumerate(shapes)}


def toy_loss(params, x):
    return sum(jnp.sum(jnp.sin(v.astype(jnp.float32) * x) ** 2) for v in jax.tree.leaves(params))


class CopyingSink:
    """Persists synchronously (by copying), so nothing is ever pending and the engine may
    reuse every host copy. Records where each shard of each put lay, and whether it was
    writeable: ``addresses[i][(key path, index key)] = (address, writeable)``."""

    def __init__(self):
        self.saved = {}
        self.addresses = []

    def put(self, step, tree, metadata=None):
        from overlap_ckpt.hostarray import index_key

        leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, HostArray))
        self.addresses.append({(jax.tree_util.keystr(path), index_key(s.index)): (s.data.ctypes.data,
                                                                                  s.data.flags.writeable)
                               for path, leaf in leaves for s in leaf.shards})
        self.saved[step] = (jax.tree.map(lambda h: HostArray.from_numpy(h.to_numpy().copy()), tree,
                                         is_leaf=lambda x: isinstance(x, HostArray)), metadata)

    def busy_steps(self):
        return []


def run_loop(tx, params, *, window, interval, steps, nan_step=None, chunk_leaves=None, shard=None,
             shard_state=False, place_state=None, before_step=None, sink=None, committed=True):
    """Train ``steps`` steps with a donating jitted step that captures in-graph.

    ``sink``: where checkpoints go (default: a :class:`MemorySink`, which keeps every copy,
    so the engine never reuses one). ``before_step(t, engine, params, opt_state)``, if
    given, runs before step ``t`` and may return a new ``(params, opt_state)`` (e.g. a tree
    change mid-window), or None. ``place_state(opt_state)``, if given, places the optimizer
    state after ``shard`` (moments laid out otherwise than their parameters, as ZeRO-1 does).
    ``committed``: the state starts committed to the device, as
    a step's outputs are after its first window step; False starts it as ``jnp.asarray``
    and ``jax.jit`` leave it, and the step compiles its plain and first-phase variants
    once for each (jit's cache key holds the inputs' commitment).
    Returns (engine, sink, references) where references[V] is a synchronous
    ``jax.device_get`` of (params, opt_state) at version V.
    """
    if shard is not None:
        params = shard(params)
    # Jitted: its outputs are new buffers (some optimizers keep the initial params in their
    # state, cocob and dowg, and the step donates params and opt_state: a buffer donated twice
    # is an error in JAX), and it is one compile, where an eager init compiles zeros_like and
    # a copy for every distinct leaf shape (14 s of a 201-leaf test). Sharded params: it
    # replicates the moments; shard_state=True lays them out like params.
    opt_state = jax.jit(tx.init)(params)
    if shard is None and committed:
        params, opt_state = jax.device_put((params, opt_state), jax.devices()[0])
    if shard is not None:
        if shard_state:
            mesh = jax.tree.leaves(params)[0].sharding.mesh
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            opt_state = optax.tree_utils.tree_map_params(
                tx, lambda s, p: jax.device_put(s, p.sharding), opt_state, params,
                transform_non_params=lambda s: jax.device_put(s, replicated))
    if place_state is not None:
        opt_state = place_state(opt_state)
    sink = MemorySink() if sink is None else sink
    engine = OverlapEngine(tx, sink, interval=interval, window=window, chunk_leaves=chunk_leaves)
    engine.plan_for(params, opt_state, {"step": jnp.int32(0)})

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def train_step(ticket, params, opt_state, x, t):
        grads = jax.grad(toy_loss)(params, x)
        if nan_step is not None:
            grads = jax.tree.map(lambda g: jnp.where(t == nan_step, jnp.nan, g).astype(g.dtype), grads)
        return capture_update(tx, ticket, params, opt_state, grads, {"step": t}, step=t)

    references = {}
    for t in range(steps):
        changed = before_step and before_step(t, engine, params, opt_state)
        if changed:
            params, opt_state = changed
            engine.plan_for(params, opt_state, {"step": jnp.int32(0)})
        params, opt_state, outbox = train_step(engine.ticket(t), params, opt_state,
                                               jnp.float32(0.1 + 0.01 * t), jnp.int32(t))
        if outbox is not None:
            engine.submit(t, outbox)
        if (t + 1) % interval == 0 and t + 1 < steps:  # its window ends at step t + 1
            references[t + 1] = jax.device_get((params, opt_state))
    engine.wait_until_finished()
    engine.close()
    return engine, sink, references


def check_windows(sink, references):
    assert sorted(sink.saved) == sorted(references), (sorted(sink.saved), sorted(references))
    for version, (params, opt_state) in references.items():
        tree, _ = sink.saved[version]
        assert_bitwise((tree["params"], tree["opt_state"]), (params, opt_state), f"version {version}")
        assert int(tree["extras"]["step"].to_numpy()) == version


def run_python(code: str, *, devices: int = 1, timeout: int = 600,
               compile_cache: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``devices`` simulated CPU devices, on the
    run's compilation cache (:func:`shared_compile_cache`) unless ``compile_cache`` is
    False: ``overlap_ckpt.aot``'s reports read the compiler's dumps, which a program loaded
    from the cache does not write."""
    env = {k: v for k, v in os.environ.items() if compile_cache or k not in COMPILE_CACHE_VARS}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)



def run_in_subprocess(test_file: str, function: str, *args, devices: int = 1) -> None:
    """Run ``function(*args)`` of the test module ``test_file`` in a fresh interpreter (with
    ``devices`` simulated CPU devices) and fail with its stderr unless it returns: for what,
    broken, aborts the process (a runtime abort would take the test worker down with it),
    and for what needs a device count other than the test process's."""
    folder, module = os.path.split(os.path.splitext(test_file)[0])
    code = (f"import sys; sys.path[:0] = [{os.path.join(REPO, 'tests')!r}, {folder!r}]\n"
            f"from {module} import {function}\n{function}(*{args!r})\nprint('returned')\n")
    proc = run_python(code, devices=devices)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("returned"), (proc.returncode, proc.stderr[-3000:])


def compile_threads(name: str) -> list[str]:
    """A list that receives the thread name of every backend compile, from now on, of a
    jitted function whose name contains ``name`` (``"jit(step)"``). The listener stays for
    the process: give each test's step a name of its own."""
    import threading

    from jax import monitoring

    threads: list[str] = []
    monitoring.register_event_duration_secs_listener(
        lambda event, secs, fun_name="", **kw: threads.append(threading.current_thread().name)
        if event == "/jax/core/compile/backend_compile_duration" and name in fun_name else None)
    return threads
