"""Window variants compiled on the training thread are counted and told once, with the fix.

The reference is independent of the library's count: the jitted step's own cache
(``_cache_size``: a variant compiled by the call on the training thread adds an entry) and
a compile listener of the test's own, recording the thread of every XLA compile.
"""

from __future__ import annotations

import functools
import logging
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.experimental.compilation_cache import compilation_cache

import overlap_ckpt as oc
from overlap_ckpt.manager import training_compiles

LOGGER = "overlap_ckpt.manager.training_compiles"
WINDOW, INTERVAL = 2, 3


@pytest.fixture(autouse=True)
def compile_without_the_cache():
    """A program answered by the run's shared compilation cache (tests/conftest.py) is not
    compiled, and costs the training thread no compile: these tests need real compiles."""
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.fixture
def main_thread_compiles():
    """Seconds of every XLA compile on this thread during the test, recorded by the test
    itself (jax has no public way to remove a listener: this one goes inert after)."""
    thread, seen, active = threading.current_thread(), [], [True]

    def listener(event, duration_secs, **_):
        if active and event == training_compiles.COMPILE_EVENT and threading.current_thread() is thread:
            seen.append(duration_secs)
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    active.clear()


def loop(tmp_path, ahead_args=None, steps=2 * INTERVAL + 2, features=5):
    """A Linen loop with windows of WINDOW steps every INTERVAL steps; returns the manager,
    the step, and the step's cache size before and after each window step."""
    model = nn.Dense(features)
    x, y = jnp.ones((4, 3)), jnp.zeros((4, features))
    state = oc.TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
                                 tx=optax.adam(1e-2))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, x, y):
        grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    grown = []
    mngr = oc.CheckpointManager(tmp_path, save_interval_steps=INTERVAL, window=WINDOW)
    state = mngr.prepare(state)
    if ahead_args is not None:
        mngr.compile_ahead(train_step, state, *ahead_args(x, y))
    for _ in range(steps):
        window_step = mngr.next_window_phase is not None
        before = train_step._cache_size()
        state = mngr.step(train_step(state, x, y))
        if window_step:
            grown.append(train_step._cache_size() - before)
    mngr.wait_until_finished()
    return mngr, grown


def test_variants_compiled_on_the_training_thread_are_told_once_with_the_fix(tmp_path, caplog,
                                                                          main_thread_compiles):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mngr, grown = loop(tmp_path)
    assert grown[:WINDOW] == [1] * WINDOW and not any(grown[WINDOW:]), grown  # the first window compiled
    told = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(told) == 1, told  # the second window compiled nothing
    assert "on the training thread" in told[0] and "mngr.compile_ahead(" in told[0], told
    counted = training_compiles.seconds(mngr)
    assert 0 < counted <= sum(main_thread_compiles), (counted, main_thread_compiles)
    mngr.close()


def test_variants_compiled_ahead_cost_the_training_thread_no_compile(tmp_path, caplog, main_thread_compiles):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mngr, grown = loop(tmp_path, ahead_args=lambda x, y: (x, y))
        window_compiles_on_main = training_compiles.seconds(mngr)
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert window_compiles_on_main == 0
    mngr.close()


def test_compile_ahead_given_other_arguments_is_told(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mngr, grown = loop(tmp_path, ahead_args=lambda x, y: (x[:2], y[:2]))  # another batch size
    assert grown[:WINDOW] == [1] * WINDOW, grown
    told = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(told) == 1 and "although compile_ahead was called" in told[0], told
    mngr.close()
