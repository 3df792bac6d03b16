"""The host budget: refused below one checkpoint, waits or skips when earlier copies are in
flight (each one counted once), and host copies are reused, not reallocated, across windows."""

from __future__ import annotations

import logging
import re
import threading

import jax
import optax
import pytest

import overlap_ckpt.core.engine as engine_module
from overlap_ckpt.errors import ConfigError
from overlap_ckpt.manager.host_budget import Footprint, HostBudget
from overlap_ckpt.manager import CheckpointManager
from overlap_ckpt.storage import hooks

from conftest import make_params, run_loop
from doors.test_manager import make_state, run


def test_budget_below_one_checkpoint_is_refused_at_prepare_naming_the_minimum(tmp_path):
    with CheckpointManager(tmp_path / "probe", save_interval_steps=4, window=2) as probe:
        probe.prepare(make_state())
        copy, scratch = probe.engine.footprint()
        slice_bytes = max(sum(probe.engine.plan.params[p.leaf].row_bytes * (p.stop - p.start) for p in s)
                          for s in probe.engine.plan.slicing.slices)
    minimum = copy + scratch
    assert slice_bytes < copy <= minimum
    for too_small in (slice_bytes - 1, minimum - 1):
        mngr = CheckpointManager(tmp_path / str(too_small), save_interval_steps=4, window=2,
                                 max_host_bytes=too_small)
        with pytest.raises(ConfigError, match=rf"at least {minimum} bytes") as info:
            mngr.prepare(make_state())
        assert f"max_host_bytes >= {minimum}" in str(info.value)
        mngr.close()
    with CheckpointManager(tmp_path / "ok", save_interval_steps=4, window=2, max_host_bytes=minimum) as mngr:
        run(mngr, mngr.prepare(make_state()), 0, 9)
        mngr.wait_until_finished()
        assert mngr.all_steps() == [4, 8]


def test_policy_unit_wait_blocks_and_skip_declines_each_counted_once(caplog):
    caplog.set_level(logging.WARNING, logger="overlap_ckpt.manager.host_budget")
    held = [100]
    waits = []

    def wait():
        waits.append(1)
        held[0] = 0

    budget = HostBudget(on_full="wait")
    assert budget.bind(Footprint(copy=80, scratch=10)) == 80 + 10 + 80  # small states: room for two copies
    assert HostBudget().bind(Footprint(copy=100 << 20, scratch=5 << 20)) == 125 << 20
    budget = HostBudget(max_host_bytes=150, on_full="wait")
    budget.bind(Footprint(copy=80, scratch=10))
    assert budget.admit(4, lambda: held[0], wait) and waits == [1]
    assert budget.admit(8, lambda: held[0], wait) and waits == [1]  # room now: no wait
    summary = budget.summary()
    assert (summary.admitted, summary.delayed, summary.skipped_steps) == (2, 1, [])
    skip = HostBudget(max_host_bytes=150, on_full="skip")
    skip.bind(Footprint(copy=80, scratch=10))
    assert not skip.admit(12, lambda: 100, wait) and waits == [1]
    assert skip.summary().skipped_steps == [12]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("step 4 delayed" in m for m in messages) == 1
    assert sum("step 12 skipped" in m for m in messages) == 1
    # The reason adds up however small the state (100 + 90 bytes against 150: 40 over), where
    # MiB alone read "hold 0.0 MiB ... needs 0.0 MiB; max_host_bytes=150 (0.0 MiB)".
    assert sum("still hold 100 bytes of host memory and this one needs 90 bytes, 40 bytes more than "
               "max_host_bytes=150 (150 bytes) allows" in m for m in messages) == 2, messages
    kib = HostBudget(max_host_bytes=(1 << 20) + 250, on_full="skip")
    kib.bind(Footprint(copy=8 << 10, scratch=2 << 10))
    assert not kib.admit(16, lambda: 1 << 20, wait)
    assert ("still hold 1.0 MiB of host memory and this one needs 10.0 KiB, 9.8 KiB more than "
            "max_host_bytes=1048826 (1.0 MiB) allows") in caplog.records[-1].getMessage()
    with pytest.raises(ConfigError, match="on_host_budget"):
        HostBudget(on_full="drop")


@pytest.mark.parametrize("policy", ["wait", "skip"])
def test_manager_waits_or_skips_while_a_persist_is_stuck(tmp_path, policy, caplog):
    """Step 4's persist is held until step 8's window would start: 'wait' blocks that step
    until the persist ends and takes checkpoint 8; 'skip' declines checkpoint 8."""
    caplog.set_level(logging.WARNING)
    release = threading.Event()

    def hook(stage, info):
        if stage == "start" and info["step"] == 4:
            release.wait(60)

    previous = hooks.set_fault_hook(hook)
    try:
        with CheckpointManager(tmp_path / "probe", save_interval_steps=4, window=1) as probe:
            probe.prepare(make_state())
            one_checkpoint = sum(probe.engine.footprint())
        with CheckpointManager(tmp_path / "run", save_interval_steps=4, window=1, on_host_budget=policy,
                               max_host_bytes=one_checkpoint) as mngr:
            state = run(mngr, mngr.prepare(make_state()), 0, 7)
            mngr.engine.flush()
            threading.Timer(0.5, release.set).start()  # the stuck persist ends later
            state = run(mngr, state, 7, 9)  # step 8's window starts while step 4 is stuck
            mngr.wait_until_finished()
            state = run(mngr, state, 9, 13)  # nothing in flight: step 12 starts at once
            mngr.wait_until_finished()
            summary = mngr.summary()
            if policy == "wait":
                assert mngr.all_steps() == [4, 8, 12] and mngr.skipped_steps() == []
                assert summary.delayed == 1 and summary.delay_seconds > 0
            else:
                assert mngr.all_steps() == [4, 12] and mngr.skipped_steps() == [8]
                assert summary.delayed == 0 and summary.skipped_steps == [8]
            assert re.search(r"\d+ checkpoint\(s\) started, \d+ delayed", str(summary))
    finally:
        release.set()
        hooks.set_fault_hook(previous)
    said = [r.getMessage() for r in caplog.records if "step 8" in r.getMessage()
            and ("delayed" in r.getMessage() or "skipped" in r.getMessage())]
    assert len(said) == 1, said


class _ReleasingSink:
    """Persists at once (nothing stays busy) and records the addresses of the host blocks."""

    def __init__(self):
        self.addresses = []

    def put(self, step, tree, metadata=None):
        self.addresses.append([s.data.__array_interface__["data"][0]
                               for h in jax.tree.leaves(tree["params"]) for s in h.shards])

    def busy_steps(self):
        return []


def test_host_blocks_keep_their_addresses_across_windows_and_released_copies_are_trimmed(monkeypatch):
    sink = _ReleasingSink()
    trims = []
    monkeypatch.setattr(engine_module, "trim_host_memory", lambda: trims.append(1))
    import conftest
    monkeypatch.setattr(conftest, "MemorySink", lambda: sink)
    # w000 (40 rows) is split over both steps of each window: its first rows (its first
    # shard) are the replay's outputs, memory the engine owns, which every later window
    # must reuse at the same address.
    engine, _, _ = run_loop(optax.adam(1e-2), make_params([(40, 6), (6,)]), window=2, interval=4, steps=17)
    assert len(sink.addresses) == 4
    owned = [a[0] for a in sink.addresses]
    assert len(set(owned)) == 1, f"the split leaf got new host memory in some window: {owned}"
    assert engine._pool.release_idle() > 0  # the last copy's captured views, once the sink is done
    assert trims, "a copy the sink was done with was released without giving its memory back"
