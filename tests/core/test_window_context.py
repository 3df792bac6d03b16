"""The window context: how a step learns it is in a window with nothing in the user's state.

Its cost is on other jitted functions the loop calls while a ticket is out: they are keyed
on it too. The property that keeps that cheap: each compiles at most once per window phase
and is reused by every later window (the plan, and so the ticket, compares by value).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import optax

import overlap_ckpt as oc
from overlap_ckpt.core.window_context import hand_to_next_step, window_ticket, window_tickets

from conftest import compile_threads, run_in_subprocess


class Owner:  # a manager, as far as the context is concerned
    pass


def test_the_ticket_is_thread_local_and_keys_jit():
    traced = []

    @jax.jit
    def f(x):
        traced.append(window_tickets())
        return x + 1

    owner = Owner()
    f(1.0)
    hand_to_next_step(owner, "phase-0")
    try:
        seen = []
        other = threading.Thread(target=lambda: seen.append(window_tickets()))
        other.start()
        other.join()
        assert seen == [()]  # the engine's and the compile-ahead threads are not in the window
        f(1.0)
        f(1.0)
        with window_ticket("phase-1"):
            f(1.0)
        assert window_tickets() == ("phase-0",)  # a with block restores what was handed out
    finally:
        hand_to_next_step(owner, None)
    f(1.0)
    assert traced == [(), ("phase-0",), ("phase-1",)]  # one trace per value, then cache hits


def test_the_same_tickets_key_jit_alike_whichever_manager_entered_its_window_first():
    """Two managers' windows overlap in one order in one cycle and in the other order later
    (different intervals): the same tickets must make the same key, or the step compiles the
    same window variant again on the training thread."""
    first, second = Owner(), Owner()
    try:
        hand_to_next_step(first, "first-phase-0")
        hand_to_next_step(second, "second-phase-0")
        keyed_then = window_tickets()
        hand_to_next_step(first, None)
        hand_to_next_step(second, None)
        hand_to_next_step(second, "second-phase-0")
        hand_to_next_step(first, "first-phase-0")
        assert window_tickets() == keyed_then
    finally:
        hand_to_next_step(first, None)
        hand_to_next_step(second, None)
    assert window_tickets() == ()


def test_other_jitted_functions_compile_once_per_phase_then_never_again(tmp_path):
    params = {"w": jnp.ones((4, 3)) / 4, "b": jnp.zeros(3)}
    x = jnp.linspace(0.0, 1.0, 8).reshape(2, 4)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state):
        grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    eval_traces = []

    @jax.jit
    def evaluate(params):  # called on the loop's thread between steps, as eval/metrics code is
        eval_traces.append(window_tickets())
        return jnp.sum(params["w"])

    state = oc.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    with oc.CheckpointManager(tmp_path, save_interval_steps=4, window=2) as mngr:
        state = mngr.prepare(state)
        for t in range(13):  # windows of 4, 8 and 12
            evaluate(state.params)
            state = mngr.step(train_step(state))
            if mngr.next_window_phase == 0:
                mngr.wait_until_finished()  # no checkpoint dropped for a slow disk: this is about compiles
            if t == 4:
                after_first_window = len(eval_traces)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8, 12]
    assert after_first_window == 3  # the plain program and one per window phase
    assert len(eval_traces) == 3, [[t.phase for t in ts] for ts in eval_traces]
    assert window_tickets() == ()  # closing the manager leaves plain steps behind


def gan_loop(directory, donate: bool) -> None:
    """A GAN-like loop: two states with their own optimizers, each with a manager, stepped in
    one jitted function; their windows overlap. Each checkpoint equals its own state."""
    import numpy as np

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

    def new(tx, scale):
        params = {"w": jnp.full((4, 3), scale), "b": jnp.zeros(3)}
        return oc.TrainState.create(apply_fn=None, params=params, tx=tx)

    # Both states have leaves of the same shapes: donated, each could be paired by jit with a
    # host copy of the other (see overlap_ckpt.core.capture.to_host).
    @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
    def train_step(gen, disc):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))
        return gen.apply_gradients(grads=g(gen.params)), disc.apply_gradients(grads=g(disc.params))

    with oc.CheckpointManager(f"{directory}/gen", save_interval_steps=4, window=2) as mg, \
            oc.CheckpointManager(f"{directory}/disc", save_interval_steps=4, window=2) as md:
        gen, disc = mg.prepare(new(optax.adam(1e-2), 0.1)), md.prepare(new(optax.sgd(1e-1, 0.9), -0.2))
        snaps = {}
        for t in range(9):
            gen, disc = train_step(gen, disc)
            gen, disc = mg.step(gen), md.step(disc)
            if t + 1 in (4, 8):
                snaps[t + 1] = {name: jax.tree.map(np.array, (s.params, s.opt_state))
                                for name, s in (("gen", gen), ("disc", disc))}
            if mg.next_window_phase == 0:
                mg.wait_until_finished()
                md.wait_until_finished()
        for name, mngr in (("gen", mg), ("disc", md)):
            mngr.wait_until_finished()
            assert mngr.all_steps() == [4, 8], name
            for step in (4, 8):
                saved = mngr.restore(step)
                want_params, want_opt = snaps[step][name]
                for got, want in zip(jax.tree.leaves((saved["params"], saved["opt_state"])),
                                     jax.tree.leaves((want_params, want_opt))):
                    assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), \
                        (name, step)


def test_a_loop_that_steps_two_states_at_different_rates_compiles_each_set_of_tickets_once(tmp_path):
    """A WGAN-style loop: the critic steps every iteration, the generator every second one,
    each with its own jitted step and manager. The generator's ticket stays out over two
    critic steps, so the critic's windows start before it in some cycles and after it in
    others: the same tickets, handed out in both orders. Each step must be traced once per
    distinct set of tickets it runs under, never again for the same set."""
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    txs = {"gen": optax.adam(1e-2), "critic": optax.sgd(1e-1, 0.9)}
    traced = {"gen": [], "critic": []}

    def jitted(name):
        @functools.partial(jax.jit, donate_argnums=0)
        def train_step(state):
            traced[name].append(frozenset((next(n for n, tx in txs.items() if tx is t.plan.tx), t.phase)
                                          for t in window_tickets()))
            grads = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(state.params)
            return state.apply_gradients(grads=grads)
        return train_step

    def new(tx):
        params = {"w": jnp.full((4, 3), 0.1, jnp.float32), "b": jnp.zeros(3, jnp.float32)}
        return oc.TrainState.create(apply_fn=None, params=params, tx=tx)

    gen_step, critic_step = jitted("gen"), jitted("critic")
    with oc.CheckpointManager(f"{tmp_path}/gen", save_interval_steps=4, window=2) as mg, \
            oc.CheckpointManager(f"{tmp_path}/critic", save_interval_steps=3, window=2) as mc:
        gen, critic = mg.prepare(new(txs["gen"])), mc.prepare(new(txs["critic"]))
        for t in range(50):
            critic = mc.step(critic_step(critic))
            if t % 2:
                gen = mg.step(gen_step(gen))
        mg.wait_until_finished()
        mc.wait_until_finished()
        assert mg.all_steps()[-1] == 24 and mc.all_steps()[-1] == 48
    for name, sets in traced.items():
        assert len(sets) == len(set(sets)), (name, [sorted(s) for s in sets])


def test_the_keys_of_a_shared_step_cover_windows_far_apart():
    """Intervals of 10000 and 6000 steps (common period 30000, windows at its end): every
    combination the step runs under in the first manager's windows, and only those."""
    import dataclasses as dc

    from overlap_ckpt.core.ticket import WindowTicket
    from overlap_ckpt.core.schedule import WindowSchedule
    from overlap_ckpt.core.window_context import keyed, shared_step_keys

    @dc.dataclass(frozen=True)
    class Plan:  # what a ticket reads of a plan
        k: int

    first, second = Owner(), Owner()
    windows = {first: (WindowSchedule(10000, 2), Plan(2)), second: (WindowSchedule(6000, 3), Plan(3))}
    a, b = ([WindowTicket(plan, j) for j in range(plan.k)] for _, plan in windows.values())
    assert shared_step_keys(first, windows) == [
        keyed({first: a[0]}), keyed({first: a[1]}),  # steps 9999 and 10000 (and 19999, 20000)
        keyed({first: a[0], second: b[1]}), keyed({first: a[1], second: b[2]}),  # 29999, 30000
    ]


def test_compile_ahead_of_a_step_shared_by_two_managers_compiles_the_phases_they_run_together(tmp_path):
    """A GAN step given to both managers' compile_ahead, windows of every 4 and every 6
    steps (they meet at 12 and 24): the training thread compiles the plain step only, every
    window variant, alone or combined, comes from the background compiles, and each
    checkpoint equals its state's synchronous snapshot."""
    import numpy as np

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def shared_gan_step(gen, disc):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2))
        return gen.apply_gradients(grads=g(gen.params)), disc.apply_gradients(grads=g(disc.params))

    def new(tx, scale):
        params = {"w": jnp.full((4, 3), scale, jnp.float32), "b": jnp.zeros(3, jnp.float32)}
        return oc.TrainState.create(apply_fn=None, params=params, tx=tx)

    threads = compile_threads("jit(shared_gan_step)")
    with oc.CheckpointManager(f"{tmp_path}/gen", save_interval_steps=4, window=2) as mg, \
            oc.CheckpointManager(f"{tmp_path}/disc", save_interval_steps=6, window=2) as md:
        gen, disc = mg.prepare(new(optax.adam(1e-2), 0.1)), md.prepare(new(optax.sgd(1e-1, 0.9), -0.2))
        mg.compile_ahead(shared_gan_step, gen, disc)
        md.compile_ahead(shared_gan_step, gen, disc)
        snaps = {}
        for t in range(25):
            gen, disc = shared_gan_step(gen, disc)
            gen, disc = mg.step(gen), md.step(disc)
            snaps[t + 1] = {name: jax.tree.map(np.array, (s.params, s.opt_state))
                            for name, s in (("gen", gen), ("disc", disc))}
        for name, mngr, steps in (("gen", mg, [4, 8, 12, 16, 20, 24]), ("disc", md, [6, 12, 18, 24])):
            mngr.wait_until_finished()
            assert mngr.all_steps()[-len(steps):] == steps, name
            for step in steps:
                saved = mngr.restore(step)
                for got, want in zip(jax.tree.leaves((saved["params"], saved["opt_state"])),
                                     jax.tree.leaves(snaps[step][name])):
                    assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), (name, step)
    assert threads.count("MainThread") == 1, threads  # the plain step, the user's own program
    # In the background: each manager's two phases alone and the two pairs run where windows
    # meet (a pair both managers compile at once may compile twice).
    assert threads.count("overlap-ckpt-compile-ahead") >= 2 + 2 + 2, threads


def test_two_managers_in_windows_at_once_each_capture_their_own_state(tmp_path):
    gan_loop(tmp_path, donate=False)


def test_two_donated_states_in_one_step(tmp_path):
    """Both states donated: the runtime aborted the process at the first window step when
    jit paired a donated leaf of one state with a host copy of the other, so the loop runs in
    a subprocess."""
    run_in_subprocess(__file__, "gan_loop", str(tmp_path), True)
