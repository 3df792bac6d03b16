# compile_ahead right after prepare; the windows then run the variants it compiled.
import tempfile

import overlap_ckpt
from _linen_setup import batch, new_state, train_step

mngr = overlap_ckpt.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=4, window=2)
state = new_state()
# <snippet>
for _ in range(9):
    state = mngr.step(train_step(state, batch))
mngr.wait_until_finished()
assert mngr.all_steps() == [4, 8]
mngr.close()
