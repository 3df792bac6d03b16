"""Host copies are reused across windows once the sink has persisted them."""

import jax
import optax

import overlap_ckpt.core.engine as engine_module
from overlap_ckpt import HostArray

from conftest import assert_bitwise, make_params, run_loop


class CopyingSink:
    """Persists synchronously (by copying), so nothing is ever pending."""

    def __init__(self):
        self.saved = {}
        self.buffer_ids = []
        self.adopted_writeable = []

    def put(self, step, tree, metadata=None):
        # w000 (40 rows) is split over both window steps: it is copied into host blocks,
        # which are reused. w001 is wholly in the last slice: handed over as captured.
        self.buffer_ids.append(id(tree["params"]["w000"].shards[0].data))
        self.adopted_writeable.append(tree["params"]["w001"].shards[0].data.flags.writeable)
        self.saved[step] = (jax.tree.map(lambda h: HostArray.from_numpy(h.to_numpy().copy()), tree,
                                         is_leaf=lambda x: isinstance(x, HostArray)), metadata)

    def busy_steps(self):
        return []


def test_host_copy_reused_and_checkpoints_stay_exact(monkeypatch):
    sink = CopyingSink()
    monkeypatch.setattr(engine_module, "MemorySink", lambda: sink)
    import conftest
    monkeypatch.setattr(conftest, "MemorySink", lambda: sink)
    _, _, refs = run_loop(optax.adam(1e-2), make_params([(40, 6), (6,)]), window=2, interval=4, steps=17)
    assert sorted(sink.saved) == [4, 8, 12, 16]
    for version, ref in refs.items():
        tree, _ = sink.saved[version]
        assert_bitwise((tree["params"], tree["opt_state"]), ref, f"version {version}")
    assert len(set(sink.buffer_ids)) == 1, "every window should reuse the same host copy"
    assert sink.adopted_writeable == [False] * 4, "the last slice should be a view of the capture, not a copy"
