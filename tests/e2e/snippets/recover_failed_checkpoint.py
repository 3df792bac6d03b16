# The checkpoint of step 4 hits a full disk (ENOSPC from the storage layer's fault hook);
# the recipe reports it and keeps training; nothing is lost from the state.
import errno
import tempfile
import time

import overlap_ckpt
from overlap_ckpt.storage import set_fault_hook
from _linen_setup import batch, new_state, train_step

alerts = []
alert = alerts.append


def full_disk_at_step_4(stage, info):
    if stage == "data_written" and info["step"] == 4:
        raise OSError(errno.ENOSPC, "No space left on device")


set_fault_hook(full_disk_at_step_4)
mngr = overlap_ckpt.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=4, window=2)
state = mngr.prepare(new_state())
for t in range(10):
    state = train_step(state, batch)
    # <snippet>
    if t == 5:  # let the persist of step 4 fail before the next step (it runs in the background)
        mngr.engine.flush()
        while mngr.store.pending_steps():
            time.sleep(0.01)
mngr.wait_until_finished()
assert len(alerts) == 1 and [f.step for f in alerts[0].failures] == [4], alerts
assert "ENOSPC" in str(alerts[0]) and mngr.all_steps() == [8]  # the next checkpoint committed
assert int(state.step) == 10  # every step's update is in the state
mngr.close()
