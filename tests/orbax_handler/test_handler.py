"""The Orbax door: overlapped saves through a user's own ``ocp.CheckpointManager``, restored
bitwise by a *stock* manager (no custom registry)."""

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import overlap_ckpt as oc
from overlap_ckpt.orbax_handler import handler as orbax_door
from overlap_ckpt.errors import WindowAborted
from conftest import assert_bitwise, make_params, toy_loss

INTERVAL, WINDOW, STEPS = 3, 2, 7  # windows end at versions 3 and 6


def _train_and_save(directory, save_future: bool):
    tx = optax.adam(1e-2)
    params = make_params([(4, 3), (5,)])
    opt_state = tx.init(params)
    copies = oc.HostCopySink()
    engine = oc.OverlapEngine(tx, copies, interval=INTERVAL, window=WINDOW)
    engine.plan_for(params, opt_state, {"step": jnp.int32(0)})

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def train_step(ticket, params, opt_state, x, t):
        grads = jax.grad(toy_loss)(params, x)
        return oc.capture_update(tx, ticket, params, opt_state, grads, {"step": t}, step=t)

    references = {}
    mngr = ocp.CheckpointManager(directory, handler_registry=oc.overlap_handler_registry())
    for t in range(STEPS):
        if t % INTERVAL == 0 and t > 0:  # synchronous reference of version t (input of step t)
            references[t] = jax.device_get((params, opt_state))
        ticket = engine.ticket(t)
        params, opt_state, outbox = train_step(ticket, params, opt_state,
                                               jnp.float32(0.1 + 0.01 * t), jnp.int32(t))
        if outbox is not None:
            engine.submit(t, outbox)
            if ticket.last:
                if save_future:
                    item = copies.take(t)  # resolved later by the engine's worker
                else:
                    engine.wait_until_finished()
                    item = copies.take(t).result(timeout=0)
                assert mngr.save(t, args=oc.OverlapSave(item))
    engine.wait_until_finished()
    engine.close()
    mngr.wait_until_finished()
    mngr.close()
    return references


@pytest.mark.parametrize("save_future", [True, False])
def test_overlap_save_restored_bitwise_by_stock_orbax(tmp_path, save_future):
    references = _train_and_save(tmp_path, save_future)
    assert sorted(references) == [3, 6]
    stock = ocp.CheckpointManager(tmp_path)  # no registry, overlap_ckpt not involved
    assert stock.all_steps() == [3, 6]
    for version, (params, opt_state) in references.items():
        # The step metadata names Orbax's own handler: no overlap_ckpt import needed to read.
        handlers = stock.metadata(version).item_handlers
        assert handlers["default"] == ocp.StandardCheckpointHandler.typestr(), handlers
        tree = stock.restore(version)  # numpy leaves, no target
        assert int(np.asarray(tree["extras"]["step"])) == version
        assert_bitwise(tree["params"], params, f"params {version}")
        # adam's state is (ScaleByAdamState(count, mu, nu), EmptyState()): Orbax restores it
        # without a target as [{"count", "mu", "nu"}, None]; same leaves, same order.
        assert_bitwise(tree["opt_state"], opt_state, f"opt_state {version}")
        # Onto a target structure (jax.Arrays), still stock Orbax.
        target = {"params": params, "opt_state": opt_state, "extras": {"step": np.zeros((), np.int32)}}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = stock.restore(version, args=ocp.args.StandardRestore(abstract))
        assert_bitwise((restored["params"], restored["opt_state"]), (params, opt_state), "target")
    stock.close()
    # overlap_ckpt's own store reads it too (and checks every chunk's crc32c).
    with oc.storage.CheckpointStore(tmp_path, read_only=True) as store:
        assert store.verify(6).ok
        tree, _ = store.restore(6)
        assert_bitwise(tree["params"], references[6][0], "CheckpointStore")


def test_registry_also_serves_standard_save_and_restore(tmp_path):
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": {"c": jnp.int32(7)}}
    with ocp.CheckpointManager(tmp_path, handler_registry=oc.overlap_handler_registry()) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(tree))  # device arrays: Orbax's own handler
        host = {"a": oc.HostArray.from_numpy(np.ones((2, 3), np.float32)), "b": {"c": np.int32(8)}}
        mngr.save(2, args=oc.OverlapSave(host))
        mngr.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        one = mngr.restore(1, args=ocp.args.StandardRestore(abstract))
        two = mngr.restore(2, args=ocp.args.StandardRestore(abstract))
    assert_bitwise(one, tree, "StandardSave")
    assert_bitwise(two, {"a": np.ones((2, 3), np.float32), "b": {"c": np.int32(8)}}, "OverlapSave")


def test_device_arrays_refused_in_the_callers_thread():
    with pytest.raises(TypeError, match="StandardSave"):
        oc.OverlapSave({"w": jnp.ones(3)})


def test_host_copy_sink_resolves_in_window_order():
    sink = oc.HostCopySink(max_unclaimed=1)
    early, late = sink.take(3), sink.take(6)
    sink.put(6, {"x": 1})
    assert late.result(timeout=0) == {"x": 1}
    with pytest.raises(WindowAborted):
        early.result(timeout=0)  # a later window completed first: 3 was discarded
    sink.put(9, {"x": 2})
    sink.put(12, {"x": 3})  # nobody took 9: dropped (max_unclaimed=1)
    assert sink.take(12).result(timeout=0) == {"x": 3}
    assert not sink.take(9).done()


def test_future_timeout_is_reported(tmp_path):
    with pytest.raises(TimeoutError, match="engine.submit"):
        orbax_door._resolve(oc.OverlapSave(concurrent.futures.Future(), timeout_s=0.01))
