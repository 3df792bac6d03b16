"""The store contract (overlap_ckpt.storage.protocol.Store) is the whole of what the manager
needs: a manager given a store that answers only the contract's members trains, checkpoints
in windows, saves, restores and drains as with the store itself, and both stores implement
every member with a compatible signature."""

from __future__ import annotations

import inspect

import jax
import numpy as np

from overlap_ckpt import CheckpointManager
from overlap_ckpt.manager import preemption
from overlap_ckpt.storage import CheckpointStore
from overlap_ckpt.storage.protocol import Store
from overlap_ckpt.tiers import LocalTier, TieredStore

from doors.test_manager import make_state, run

MEMBERS = sorted(n for n in dir(Store) if not n.startswith("_"))


class OnlyTheContract:
    """A store that answers the contract's members and nothing else."""

    def __init__(self, inner):
        self._inner = inner
        self.used: set[str] = set()

    def __getattr__(self, name):
        if name not in MEMBERS:
            raise AttributeError(f"the manager used store.{name}, which the Store contract does not declare")
        self.used.add(name)
        return getattr(self._inner, name)


def test_a_manager_needs_nothing_of_its_store_beyond_the_contract(tmp_path):
    store = OnlyTheContract(CheckpointStore(tmp_path / "ckpt", max_to_keep=3, on_backpressure="block"))
    with CheckpointManager(save_interval_steps=4, window=2, store=store) as mngr:
        state = run(mngr, mngr.prepare(make_state()), 0, 9)
        assert mngr.save(9, state, force=True)
        done, error, _ = preemption.drain(mngr, deadline_s=60)
        assert done and error is None
        assert mngr.all_steps() == [4, 8, 9] and mngr.skipped_steps() == [] and mngr.failed_steps() == []
    with CheckpointManager(tmp_path / "ckpt") as reader:
        expected = reader.restore(9)
    reading = OnlyTheContract(CheckpointStore(tmp_path / "ckpt"))
    with CheckpointManager(save_interval_steps=4, store=reading) as again:
        restored = again.restore(None, make_state())  # the newest: 9
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(expected["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert {"put", "save", "promote_newest", "flush"} <= store.used
    assert {"restore", "step_to_restore"} <= reading.used


def test_both_stores_implement_every_member_of_the_contract(tmp_path):
    stores = [CheckpointStore(tmp_path / "durable"),
              TieredStore(CheckpointStore(tmp_path / "tiered"), LocalTier(tmp_path / "local", every=2), 4)]
    for store in stores:
        implementation = type(store)
        assert isinstance(store, Store)
        for name in MEMBERS:
            assert hasattr(store, name), f"{implementation.__name__} lacks Store.{name}"
            declared = getattr(Store, name)
            if isinstance(declared, property):
                continue
            wanted = inspect.signature(declared).parameters
            got = inspect.signature(getattr(implementation, name)).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in got.values())
            for parameter in wanted:
                assert parameter in got or takes_any, f"{implementation.__name__}.{name} lacks {parameter!r}"
        store.close()
