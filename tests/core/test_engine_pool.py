"""Host copies are reused across windows once the sink has persisted them."""

import optax

from conftest import CopyingSink, assert_bitwise, make_params, run_loop


def test_host_copy_reused_and_checkpoints_stay_exact():
    # w000 (40 rows) is split over both window steps: its rows in the first slice are the
    # replay's outputs, which are reused. w001 is wholly in the last slice: handed over as
    # captured.
    sink = CopyingSink()
    engine, _, refs = run_loop(optax.adam(1e-2), make_params([(40, 6), (6,)]), window=2, interval=4, steps=17,
                               sink=sink)
    assert sorted(sink.saved) == [4, 8, 12, 16]
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert_bitwise((tree["params"], tree["opt_state"]), ref, f"version {version}")
    (first, stop), = [(p.start, p.stop) for p in engine.plan.slicing.slices[0] if p.leaf == 0]
    replayed = {key for key in sink.addresses[0] if "w000" in key[0] and key[1][0] == (first, stop)}
    assert len(replayed) == 3, sink.addresses[0]  # w000's rows in params, mu and nu
    for key in replayed:
        assert len({seen[key][0] for seen in sink.addresses}) == 1, f"{key} in new memory in some window"
    adopted = [writeable for seen in sink.addresses for (path, _), (_, writeable) in seen.items()
               if path == "['params']['w001']"]
    assert adopted == [False] * 4, "the last slice should be a view of the capture, not a copy"


def test_k3_host_owns_memory_only_for_the_slices_it_replays():
    """The last slice arrives at V and is never replayed: kept as captured, it needs no host
    memory of its own. A large last leaf (as a token embedding last in a Linen tree) used
    to be cut between the last two slices, and its whole block was then owned and copied."""
    tx = optax.adam(1e-2)
    engine, sink, refs = run_loop(tx, make_params([(16, 6)] * 4 + [(40, 6)]), window=3, interval=4, steps=9)
    plan = engine.plan
    replayed = {p.leaf for s in plan.slicing.slices[:-1] for p in s}
    assert replayed == {0, 1, 2, 3}, plan.slicing
    replayed_bytes = sum(3 * plan.params[k].rows * plan.params[k].row_bytes for k in replayed)  # params, mu, nu
    (_, buffers), = engine._pool._lent[-1:]
    assert buffers.nbytes == replayed_bytes, (buffers.nbytes, replayed_bytes)
    assert engine.kept_host_bytes == replayed_bytes  # what benchmarks report as kept between windows
    assert sorted(sink.saved) == [4, 8]
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert not tree["params"]["w004"].shards[0].data.flags.writeable  # the capture itself
        assert_bitwise((tree["params"], tree["opt_state"]), ref, f"version {version}")
