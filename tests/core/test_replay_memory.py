"""Host memory of a K=3 window: what the replay holds at its peak, counted independently.

Why: the host copy is the one thing a window must hold (issue 20). Before this was
checked, a K=3 window also kept each phase's captured slice alive until its replay had
finished (a third of the state twice) and cut its replay calls per phase. The count here
does not trust the engine's own accounting: it sums the numpy buffers alive (numpy
reports its data allocations to tracemalloc, in its own domain) and the jax arrays alive
on the CPU backend besides the training loop's state, at every replay call, before and
after it runs.
"""

from __future__ import annotations

import functools
import logging
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import overlap_ckpt.core.replay as replay_module
from overlap_ckpt import OverlapEngine, capture_update

from conftest import make_params, toy_loss

NUMPY_DOMAIN = 389047  # numpy's tracemalloc domain for array data (numpy/core/include/.../ndarraytypes.h)


class _Drop:
    """A sink that persists at once (keeps nothing), so only the window's memory is held."""

    def put(self, step, tree, metadata=None):
        pass

    def busy_steps(self):
        return []


def _numpy_bytes() -> int:
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, NUMPY_DOMAIN)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.fixture
def peak_held(monkeypatch):
    """Runs a K=3 window loop and returns (peak bytes held besides the training state,
    state bytes, the engine's footprint, the replay's call size)."""
    live_state: set[int] = set()
    peaks: list[int] = []
    batch_bytes = [0]
    numpy_before = [0]

    def held() -> int:
        arrays = sum(a.nbytes for a in jax.live_arrays("cpu") if id(a) not in live_state)
        return arrays + _numpy_bytes() - numpy_before[0]

    run = replay_module.ReplayPrograms.run

    def counted_run(self, *args, **kwargs):
        batch_bytes[0] = self.batch_bytes
        peaks.append(held())
        outs = run(self, *args, **kwargs)
        peaks.append(held())
        return outs

    monkeypatch.setattr(replay_module.ReplayPrograms, "run", counted_run)

    def go():
        tx = optax.adam(1e-3)
        # One large leaf cut into the three slices: its host block is allocated whole at
        # phase 0, so every replay call of phase 1 already holds the whole copy.
        params = make_params([(8192, 1024), (1024,)])
        opt_state = jax.tree.map(jnp.copy, tx.init(params))
        state_bytes = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
        engine = OverlapEngine(tx, _Drop(), interval=4, window=3)
        engine.plan_for(params, opt_state, {"step": jnp.int32(0)})

        @functools.partial(jax.jit, donate_argnums=(1, 2))
        def train_step(ticket, params, opt_state, x, t):
            grads = jax.grad(toy_loss)(params, x)
            return capture_update(tx, ticket, params, opt_state, grads, {"step": t}, step=t)

        tracemalloc.start()
        try:
            numpy_before[0] = _numpy_bytes()
            for t in range(9):  # the windows of steps 4 and 8
                params, opt_state, outbox = train_step(engine.ticket(t), params, opt_state,
                                                       jnp.float32(0.1), jnp.int32(t))
                live_state.clear()
                live_state.update(id(x) for x in jax.tree.leaves((params, opt_state)))
                if outbox is not None:
                    engine.submit(t, outbox)
                del outbox
                engine.flush()  # the replay runs while the loop holds only its state
            engine.wait_until_finished()
        finally:
            tracemalloc.stop()
        footprint = engine.footprint()
        assert engine.windows_completed == 2
        engine.close()
        return max(peaks), state_bytes, footprint, batch_bytes[0]

    return go


def test_k3_window_holds_one_copy_and_the_gradients_still_to_apply(peak_held):
    peak, state_bytes, (copy, scratch), batch_bytes = peak_held()
    # One host copy and the gradient pieces not yet applied (at phase 1: slices 0 and 1 of
    # Adam's params, 2/9 of the state), and nothing per replay call: at phase 1 the host
    # holds slice 0 (the outputs of its calls), slice 1 as captured (read in place by its
    # first calls) and slice 1's outputs, as much as the copy that slice 2 completes. A
    # replay call whose outputs went to new memory, or a captured slice also copied in,
    # held one call's outputs or a slice more (~1.55x the state when phase 1's slice was
    # copied in and kept until its replay was done). Slices are cut at multiples of 256
    # rows here (1 MiB of each array, see part_rows), so a slice may exceed a third by a
    # few MiB.
    bound = state_bytes * (1 + 2 / 9) + (6 << 20)
    assert peak <= bound, (f"a K=3 window held {peak / 2**20:.1f} MiB besides the training state, "
                           f"above {bound / 2**20:.1f} MiB (state {state_bytes / 2**20:.1f} MiB)")
    # What the host budget reserves for a checkpoint covers everything counted here.
    assert peak <= copy + scratch, (peak, copy, scratch)


def test_replay_inputs_are_the_host_blocks_themselves():
    """A row view of a host block goes into the CPU-jitted replay without a copy (JAX
    takes numpy memory as is only when it is 64-byte aligned; numpy aligns to 16)."""
    from overlap_ckpt.core.buffers import LeafBlocks
    from overlap_ckpt.core.plan import leaf_layout
    from overlap_ckpt.hostarray import index_key

    x = jnp.zeros((300, 80), jnp.float32)  # rows of 320 bytes: every row starts aligned
    for _ in range(8):  # several allocations: numpy's own would land off 64 bytes some of the time
        block = LeafBlocks(leaf_layout(x))[index_key(leaf_layout(x).blocks[0])]
        view = block[3:250]
        assert jax.device_put(view).unsafe_buffer_pointer() == view.ctypes.data


def _call_addresses(monkeypatch) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """Where the outputs of each replay call lay after each of its runs, by call."""
    addresses: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    advance = replay_module.WindowReplay._advance

    def recorded(self, call, *args, **kwargs):
        advance(self, call, *args, **kwargs)
        addresses.setdefault(call, []).append(tuple(x.unsafe_buffer_pointer() for x in self.buffers.calls[call]))

    monkeypatch.setattr(replay_module.WindowReplay, "_advance", recorded)
    return addresses


def test_replay_outputs_land_in_the_same_buffers_every_call(monkeypatch):
    """Every replay call writes its outputs, which are the host copy of its rows, into the
    buffers it wrote at the phase before (its inputs, donated: in place) and, once the sink
    is done with a copy, in the window before: fresh output memory per call is what made
    the replay run at a fraction of a memcpy (page faults), and the checkpoints stay exact.
    The first run of a call writes into the zeros made for it (not new memory beside them:
    a ``device_put`` of numpy zeros, even with ``may_alias=False``, was not always written
    into, and the first window held its outputs twice)."""
    from conftest import CopyingSink, assert_bitwise, run_loop

    addresses = _call_addresses(monkeypatch)
    made: set[int] = set()  # where the first runs' output buffers were made
    init = replay_module.ReplayPrograms.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        zeros = self._zeros

        def recorded(signature):
            buffers = zeros(signature)
            made.update(x.unsafe_buffer_pointer() for x in buffers)
            return buffers

        self._zeros = recorded

    monkeypatch.setattr(replay_module.ReplayPrograms, "__init__", recording_init)
    sink = CopyingSink()
    engine, _, refs = run_loop(optax.adam(1e-2), make_params([(16384, 128), (128,), (8192, 128)]),
                               window=3, interval=4, steps=13, sink=sink)
    plan = engine.plan
    assert plan.chunked and len(refs) == 3
    assert max(len(engine._programs[plan].slice_batches(i)) for i in range(plan.k - 1)) > 1, "several calls a slice"
    for (i, b), seen in addresses.items():
        assert len(seen) == len(refs) * (plan.k - 1 - i), f"call {(i, b)} ran {len(seen)} times"
        assert len(set(seen)) == 1, f"call {(i, b)} wrote its outputs in new memory {len(set(seen)) - 1} times"
    every = [a for seen in addresses.values() for a in seen[0]]
    assert len(set(every)) == len(every), "two calls share an output buffer"
    assert set(every) <= made, "a first run wrote its outputs in new memory, not in the buffers made for it"
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert_bitwise((tree["params"], tree["opt_state"]), ref, f"version {version}")


def test_one_row_chunks_keep_their_buffers_beside_stand_ins_of_their_row_shape(monkeypatch, caplog):
    """Small leaves make one-row chunks, shaped like the one-row stand-ins of the leaves a call
    does not advance (and scalars like the scalar stand-ins). ``jit`` gives a donated buffer to
    the first output of its shape: were the stand-ins' outputs first, they would take the
    chunks' buffers and the chunks would go to new memory at every call (14 of a call's
    outputs here), with the warning that says a sink keeps views, which no sink does."""
    from conftest import CopyingSink, assert_bitwise, run_loop

    addresses = _call_addresses(monkeypatch)
    monkeypatch.setattr(replay_module, "_warned_new_memory", False)
    sink = CopyingSink()
    with caplog.at_level(logging.WARNING, logger=replay_module.__name__):
        engine, _, refs = run_loop(optax.adam(1e-2), make_params([(2, 3), (1, 3), (3, 3), (1, 3), ()] * 3 + [(40, 3)]),
                                   window=3, interval=4, steps=9, sink=sink)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert engine.plan.chunked and len(refs) == 2 and addresses
    for call, seen in addresses.items():
        assert len(set(seen)) == 1, f"call {call} wrote its outputs in new memory {len(set(seen)) - 1} times"
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert_bitwise((tree["params"], tree["opt_state"]), ref, f"version {version}")


def test_a_phase_ends_with_its_replay_calls_done(monkeypatch):
    """The replay of a phase returns only when its calls have run. XLA:CPU runs a call
    asynchronously and holds what it reads until then, so a phase that returned at dispatch
    left its captured slice alive into the next phase (measured on the 20M LM, K=3: a third of
    the state more). With Adam the wait hides behind the read of the step count each call
    returns; momentum SGD has no shared counter, so nothing else waits for the calls."""
    from conftest import CopyingSink, assert_bitwise, run_loop

    pending = []
    receive = replay_module.WindowReplay.receive

    def checked(self, outbox):
        receive(self, outbox)
        pending.append(sum(not x.is_ready() for outs in self.buffers.calls.values() for x in outs))

    monkeypatch.setattr(replay_module.WindowReplay, "receive", checked)
    sink = CopyingSink()
    engine, _, refs = run_loop(optax.sgd(1e-2, momentum=0.9), make_params([(16384, 512), (512,)]),
                               window=3, interval=4, steps=9, sink=sink)
    assert engine.plan.chunked and not engine.plan.analysis.shared_state
    assert len(pending) == 6, pending  # two windows of three phases
    assert pending == [0] * 6, f"replay calls still running when their phase returned: {pending}"
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert_bitwise((tree["params"], tree["opt_state"]), ref, f"version {version}")


def test_the_store_gives_the_replay_buffers_back_between_windows(monkeypatch, tmp_path, caplog):
    """With the real sink, a CheckpointStore writing through TensorStore (which may
    reference the host copy instead of copying it), the replay's outputs still go to the
    same buffers in every window once the copy before was persisted: a write that kept a
    view of them would make every window write into fresh memory, which no error reports."""
    from conftest import assert_bitwise, run_loop
    from overlap_ckpt.storage import CheckpointStore

    addresses: dict[tuple[int, int], set[tuple[int, ...]]] = {}
    advance = replay_module.WindowReplay._advance

    def recorded(self, call, *args, **kwargs):
        advance(self, call, *args, **kwargs)
        addresses.setdefault(call, set()).add(tuple(x.unsafe_buffer_pointer() for x in self.buffers.calls[call]))

    monkeypatch.setattr(replay_module.WindowReplay, "_advance", recorded)
    store = CheckpointStore(tmp_path / "ckpt")

    def persisted_before_the_next_window(t, engine, *_):
        # As at any interval longer than the write: a copy still being written is not
        # reused (BufferPool), and toy steps outrun the replay and the write.
        if t % 10 == 5:
            engine.flush()
            store.wait_until_finished()

    monkeypatch.setattr(replay_module, "_warned_new_memory", False)
    try:
        with caplog.at_level(logging.WARNING, logger=replay_module.__name__):
            engine, _, refs = run_loop(optax.adam(1e-2), make_params([(16384, 128), (128,), (8192, 128)]),
                                       window=3, interval=10, steps=41, sink=store,
                                       before_step=persisted_before_the_next_window)
        assert not caplog.records, [r.getMessage() for r in caplog.records]
        store.wait_until_finished()
        assert engine.plan.chunked and sorted(refs) == [10, 20, 30, 40] == store.all_steps()
        assert addresses and all(len(seen) == 1 for seen in addresses.values()), \
            {call: len(seen) for call, seen in addresses.items()}
        for version, (params, opt_state) in refs.items():
            target = {"params": params, "opt_state": opt_state, "extras": {"step": np.int32(0)}}
            restored, _ = store.restore(version, target=target)
            assert_bitwise((restored["params"], restored["opt_state"]), (params, opt_state), f"version {version}")
    finally:
        store.close()


def test_a_sink_that_keeps_views_it_calls_idle_is_reported(monkeypatch, caplog):
    """A sink that keeps the trees it is given but names no step busy: JAX cannot donate the
    buffers its numpy views reference and puts the replay's outputs in new memory without a
    word, a copy of the state more per window. The replay says so, once, and the checkpoints
    stay exact."""
    from conftest import CopyingSink, check_windows, run_loop

    class KeepingSink(CopyingSink):
        def put(self, step, tree, metadata=None):
            super().put(step, tree, metadata)
            self.kept = getattr(self, "kept", []) + [tree]  # the views, past "not busy"

    monkeypatch.setattr(replay_module, "_warned_new_memory", False)
    sink = KeepingSink()
    with caplog.at_level(logging.WARNING, logger=replay_module.__name__):
        _, _, refs = run_loop(optax.adam(1e-2), make_params([(16384, 128), (128,), (8192, 128)]),
                              window=3, interval=4, steps=13, sink=sink)
    check_windows(sink, refs)
    warned = [r for r in caplog.records if "new memory instead of reusing" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
