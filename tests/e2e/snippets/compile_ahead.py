# compile_ahead right after prepare; the windows then run the variants it compiled. Also the
# GPU copy schedule hint's block, which jits the step itself with the manager's compiler
# options (none on the CPU, where this runs).
import tempfile

import jax  # noqa: F401 - the hint's block calls jax.jit

import overlap_ckpt
from _linen_setup import batch, new_state, train_step

loss_and_update = train_step.__wrapped__  # the step as written, before jax.jit
mngr = overlap_ckpt.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=4, window=2)
state = new_state()
# <snippet>
for _ in range(9):
    state = mngr.step(train_step(state, batch))
mngr.wait_until_finished()
assert mngr.all_steps() == [4, 8]
mngr.close()
