# Step 8, the newest, has truncated data files; the recipe falls back to step 4.
import pathlib
import tempfile

import overlap_ckpt
import overlap_ckpt.storage
from _linen_setup import batch, new_state, train_step

directory = tempfile.mkdtemp()
with overlap_ckpt.CheckpointManager(directory, save_interval_steps=4, window=2) as mngr:
    state = mngr.prepare(new_state())
    for _ in range(9):
        state = mngr.step(train_step(state, batch))
for f in pathlib.Path(directory, "8").rglob("d/*"):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
fresh_state = new_state()
mngr = overlap_ckpt.CheckpointManager(directory, save_interval_steps=4, window=2)
# <snippet>
assert mngr.all_steps() == [4, 8] and int(state.step) == 4
mngr.close()
