"""Host copies are reused across windows once the sink has persisted them."""

import jax
import optax

import overlap_ckpt.engine as engine_module
from overlap_ckpt import HostArray

from conftest import assert_bitwise, make_params, run_loop


class CopyingSink:
    """Persists synchronously (by copying), so nothing is ever pending."""

    def __init__(self):
        self.saved = {}
        self.buffer_ids = []

    def save(self, step, tree, metadata=None):
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, HostArray))
        self.buffer_ids.append(id(leaves[0].shards[0].data))
        self.saved[step] = (jax.tree.map(lambda h: HostArray.from_numpy(h.to_numpy().copy()), tree,
                                         is_leaf=lambda x: isinstance(x, HostArray)), metadata)

    def pending_steps(self):
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
