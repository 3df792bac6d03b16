# A checkpoint written by overlap_ckpt, then read by stock Orbax only.
import tempfile

import jax
import numpy as np

from overlap_ckpt.storage import CheckpointStore

directory = tempfile.mkdtemp()
saved = {"params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "step": np.int32(3)}
with CheckpointStore(directory) as store:
    store.save(3, saved, {"run": "demo"})
step = 3
abstract_tree = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), saved)
# <snippet>
assert ocp.CheckpointManager(directory).metadata(step).custom_metadata == {"run": "demo"}
for got in (tree, ocp.CheckpointManager(directory).restore(step)):
    assert np.asarray(got["params"]["w"]).tobytes() == saved["params"]["w"].tobytes()
    assert int(got["step"]) == 3
