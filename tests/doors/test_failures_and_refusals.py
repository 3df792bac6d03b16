"""What reaches the user: background failures raised at the next call (none dropped), bad
input refused at prepare with a short error naming the cause and the fix, read-only use,
damaged and foreign directories."""

from __future__ import annotations

import errno
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import overlap_ckpt as oc
from overlap_ckpt.core import replay
from overlap_ckpt.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from overlap_ckpt.storage import CheckpointNotFoundError, CheckpointStore, CorruptCheckpointError, set_fault_hook

MAX_ERROR = 2000  # characters: an error names the cause and the fix, not the whole plan


def make_state(tx=None, cls=oc.TrainState):
    params = {"w": jnp.arange(12, dtype=jnp.float32).reshape(4, 3) / 10, "b": jnp.zeros(3)}
    return cls.create(apply_fn=None, params=params, tx=tx or optax.adam(1e-2))


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state, x):
    grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state.params)
    return state.apply_gradients(grads=grads)


def x_at(t):
    return jnp.full((2, 4), 0.1 * (t + 1), jnp.float32)


@pytest.fixture
def fault():
    """Install a storage fault hook for the test; removed afterwards."""
    previous = []

    def install(hook):
        previous.append(set_fault_hook(hook))

    yield install
    set_fault_hook(previous[0] if previous else None)


def blocking(path, **kw):
    return CheckpointStore(path, on_backpressure="block", **kw)


def settle(mngr):
    """Let the replay and the persist of what was handed over finish (deterministic tests)."""
    mngr.engine.flush()
    mngr.store.flush()


def test_every_failed_write_is_raised_at_the_next_step_and_none_is_dropped(tmp_path, fault):
    """A read-only checkpoint root (EROFS) from step 4 on: every checkpoint from then on
    fails; each failure reaches the training thread, with its step, stage and cause."""
    def read_only(stage, info):
        if stage == "data_written" and info["step"] >= 4:
            raise OSError(errno.EROFS, "Read-only file system (injected)")
    fault(read_only)
    raised = []
    with oc.CheckpointManager(save_interval_steps=2, window=1, store=blocking(tmp_path)) as mngr:
        state = mngr.prepare(make_state())
        for t in range(13):
            state = train_step(state, x_at(t))
            try:
                state = mngr.step(state)
            except CheckpointError as e:
                raised.append((t, e))
                state = mngr.step(state)  # nothing was taken from the state: go on
            settle(mngr)
        with pytest.raises(CheckpointError) as last:  # the last window's failure, not reported yet
            mngr.wait_until_finished()
        failed = mngr.failed_steps()
        assert mngr.all_steps() == [2]
    # Raised at the first step() after each failure: within one save interval.
    assert [(t, [f.step for f in e.failures]) for t, e in raised] == [(5, [4]), (7, [6]), (9, [8]), (11, [10])]
    assert [f.step for f in last.value.failures] == [12]
    assert [f.step for f in failed] == [4, 6, 8, 10, 12]
    raised = [e for _, e in raised]
    for e in raised:
        message = str(e)
        assert len(message) < MAX_ERROR and "persist" in message and "Read-only file system" in message
        assert e.__cause__ is e.failures[0].error and e.failures[0].error.errno == errno.EROFS


def test_on_error_log_keeps_training_and_still_accounts_for_every_failure(tmp_path, fault, caplog):
    def full(stage, info):
        if stage == "array_write" and info["step"] in (4, 8):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
    fault(full)
    with oc.CheckpointManager(save_interval_steps=2, window=1, on_error="log",
                              store=blocking(tmp_path)) as mngr:
        state = mngr.prepare(make_state())
        for t in range(11):
            state = mngr.step(train_step(state, x_at(t)))
            settle(mngr)
        assert mngr.all_steps() == [2, 6, 10]
        assert [(f.step, f.stage, type(f.error).__name__) for f in mngr.failed_steps()] == \
            [(4, "persist", "OutOfSpaceError"), (8, "persist", "OutOfSpaceError")]
    assert "No space left" in caplog.text


def test_a_replay_failure_names_the_step_and_the_stage(tmp_path, monkeypatch):
    original = replay.ReplayPrograms.run

    def failing(self, args, injected):
        raise TypeError("replay went wrong (injected)")
    monkeypatch.setattr(replay.ReplayPrograms, "run", failing)
    with oc.CheckpointManager(save_interval_steps=4, window=2, store=blocking(tmp_path)) as mngr:
        state = mngr.prepare(make_state())
        with pytest.raises(CheckpointError) as info:
            for t in range(9):
                stepped = train_step(state, x_at(t))
                state = mngr.step(stepped)
                settle(mngr)
        assert "step 4 failed in replay" in str(info.value) and "TypeError" in str(info.value)
        assert len(str(info.value)) < MAX_ERROR
        monkeypatch.setattr(replay.ReplayPrograms, "run", original)
        state = mngr.step(stepped)
        for t in range(t + 1, 13):
            state = mngr.step(train_step(state, x_at(t)))
        mngr.wait_until_finished()
        assert 12 in mngr.all_steps() and [f.step for f in mngr.failed_steps()] == [4]


@functools.partial(jax.jit, donate_argnums=0)
def step_or_keep(state, x, keep):
    """A loss-scaling style step: when ``keep``, the old params and moments are put back after
    the update (as Flax's DynamicScale does on a non-finite step), which the replay cannot see."""
    new = state.apply_gradients(grads=jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state.params))
    kept = functools.partial(jax.tree.map, lambda n, o: jnp.where(keep, o, n))
    return new.replace(params=kept(new.params, state.params), opt_state=kept(new.opt_state, state.opt_state))


def test_a_discarded_window_is_a_failure_that_reaches_the_user(tmp_path):
    """A window whose steps the host cannot line up (here the state put back after the
    update in the middle of the window of step 4) loses the checkpoint the loop asked for:
    it is raised at a later call with the cause and the fix, as a failed write is, and the
    next window is taken as usual. It used to be only a log line: all_steps() lacked 4."""
    raised = []
    with oc.CheckpointManager(save_interval_steps=4, window=3, store=blocking(tmp_path)) as mngr:
        state = mngr.prepare(make_state())
        for t in range(9):
            keep = t < 4 and mngr.engine.phase(int(state.step)) == 1
            state = step_or_keep(state, x_at(t), keep)
            try:
                state = mngr.step(state)
            except CheckpointError as e:
                raised.append(e)
                state = mngr.step(state)
            settle(mngr)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [8]
        assert [(f.step, f.stage) for f in mngr.failed_steps()] == [(4, "window")]
    assert len(raised) == 1 and [f.step for f in raised[0].failures] == [4]
    message = str(raised[0].failures[0].error)
    assert "apply_if_finite" in message and "mngr.step(state)" in message and len(str(raised[0])) < MAX_ERROR


def test_refusals_at_prepare_are_short_and_say_what_to_do(tmp_path):
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    lookahead = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
    noisy = optax.noisy_sgd(1e-2, key=jax.random.key(0))  # a typed key in the optimizer state
    cases = [
        (lambda m: m.prepare(make_state(cls=train_state.TrainState)), TypeError, "overlap_ckpt.TrainState"),
        (lambda m: m.prepare(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), model), TypeError,
         "overlap_ckpt.nnx.Optimizer"),
        (lambda m: m.prepare(oc.nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)), TypeError, "model"),
        (lambda m: m.prepare(make_state(lookahead)), UnsupportedOptimizerError, "lookahead"),
        (lambda m: m.prepare(make_state(noisy)), UnsupportedOptimizerError, "opt_state[0].rng_key"),
        (lambda m: m.prepare(oc.nnx.Optimizer(model, noisy, wrt=nnx.Param), model), UnsupportedOptimizerError,
         "typed PRNG key"),
        (lambda m: m.prepare({"params": 1}), TypeError, "overlap_ckpt.TrainState"),
    ]
    with oc.CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        for call, error, needle in cases:
            with pytest.raises(error) as info:
                call(mngr)
            assert needle in str(info.value) and len(str(info.value)) < MAX_ERROR, str(info.value)
    with oc.CheckpointManager(tmp_path / "t", save_interval_steps=4,
                              save_tree=lambda t: {"p": t["params"]["w"] * 2}) as mngr:
        with pytest.raises(ConfigError, match="rearrange") as info:
            mngr.prepare(make_state())
        assert len(str(info.value)) < MAX_ERROR


def test_read_only_manager_restores_without_a_schedule_or_target(tmp_path):
    with oc.CheckpointManager(tmp_path, save_interval_steps=2, window=1) as mngr:
        state = mngr.prepare(make_state())
        for t in range(5):
            state = mngr.step(train_step(state, x_at(t)))
            if t == 3:
                live = jax.device_get(state.params)  # version 4
        mngr.wait_until_finished()
    reader = oc.CheckpointManager(tmp_path)  # no save_interval_steps: read-only, no lock taken
    with oc.CheckpointManager(tmp_path, save_interval_steps=2) as trainer:  # a writer may coexist
        assert trainer.latest_step() == 4
    tree = reader.restore()  # latest, as the saved tree of numpy arrays, like Orbax
    assert int(tree["step"]) == 4 and isinstance(tree["params"]["w"], np.ndarray)
    np.testing.assert_array_equal(tree["params"]["w"], live["w"])
    restored = reader.restore(target_state=make_state())  # not prepared: nothing to train with
    assert int(restored.step) == 4
    with pytest.raises(ConfigError, match="save_interval_steps"):
        reader.prepare(make_state())
    reader.close()


def test_damaged_latest_step_falls_back_with_a_warning(tmp_path, caplog):
    with oc.CheckpointManager(tmp_path, save_interval_steps=2, window=1) as mngr:
        state = mngr.prepare(make_state())
        for t in range(5):
            state = mngr.step(train_step(state, x_at(t)))
        mngr.wait_until_finished()
    os.remove(tmp_path / "4" / "default" / "_METADATA")
    with oc.CheckpointManager(tmp_path) as reader:
        with pytest.raises(CorruptCheckpointError, match="damaged") as info:
            reader.restore(4)
        assert "item_name" not in str(info.value)
        assert int(reader.restore(target_state=make_state()).step) == 2
    assert "step 4" in caplog.text and "damaged" in caplog.text


def test_a_directory_of_another_format_is_not_silently_empty(tmp_path):
    (tmp_path / "checkpoint_1000").write_bytes(b"flax msgpack")
    with oc.CheckpointManager(tmp_path) as reader:
        with pytest.raises(CheckpointNotFoundError, match="checkpoint_1000") as info:
            reader.latest_step()
        assert len(str(info.value)) < MAX_ERROR
    (tmp_path / "README").write_text("notes")
    with oc.CheckpointManager(tmp_path / "fresh") as reader:
        assert reader.latest_step() is None


SHARD_MAP_UPDATE = r'''
import functools, tempfile
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import overlap_ckpt as oc
from overlap_ckpt.errors import ConfigError

mesh = jax.make_mesh((2,), ("d",))
params = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))}
state = oc.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))

specs = jax.tree.map(lambda a: P("d") if jnp.ndim(a) == 2 else P(), state)

@functools.partial(jax.jit, donate_argnums=0)
def train_step(state, x):
    def local(state, x):  # the whole step, update included, inside shard_map: not supported
        grads = jax.grad(lambda p: jnp.sum(x @ p["w"].T))(state.params)
        return state.apply_gradients(grads=grads)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=specs, check_vma=False)(state, x)

with oc.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=1000, window=2) as mngr:
    state = mngr.prepare(state)
    thread = mngr.compile_ahead(train_step, state, jnp.ones((2, 4)))
    state = mngr.step(train_step(state, jnp.ones((2, 4))))  # the plain step works
    thread.join()
    try:
        mngr.step(train_step(state, jnp.ones((2, 4))))
    except ConfigError as e:
        message = str(e)
        assert "shard_map" in message and len(message) < 2000, message
        print("REFUSED-EARLY")
'''


def test_an_update_inside_shard_map_is_refused_long_before_the_first_window():
    from conftest import run_python
    result = run_python(SHARD_MAP_UPDATE, devices=2)
    assert "REFUSED-EARLY" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
