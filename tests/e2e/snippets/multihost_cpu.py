# Runs this program as the 2 processes of a CPU job; each checks a save through the store.
import os
import subprocess
import sys

from _distributed import check_store, free_port, shared_dir

if "SNIPPET_PROCESS" not in os.environ:
    env = dict(os.environ, SNIPPET_PORT=str(free_port()), SNIPPET_DIR=shared_dir(),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, __file__], env=dict(env, SNIPPET_PROCESS=str(i)))
             for i in range(2)]
    codes = [p.wait(timeout=200) for p in procs]
    assert codes == [0, 0], codes
    sys.exit(0)
i, port = int(os.environ["SNIPPET_PROCESS"]), int(os.environ["SNIPPET_PORT"])
# <snippet>
from overlap_ckpt.storage import CheckpointStore  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4
store = CheckpointStore(os.environ["SNIPPET_DIR"])
assert type(store._coord).__name__ == "JaxDistributedCoordinator"
check_store(store)
store.close()
# Process 0 hosts the coordination service, and a peer whose client threads still poll it
# when process 0 exits aborts (SIGABRT, seen twice in loaded runs, once after a barrier
# here). jax.distributed's shutdown stops this process's polling and waits, in its own
# barrier, for every process to do the same; only then may any process leave.
jax.distributed.shutdown()
sys.stdout.flush()
os._exit(0)  # as tests/e2e/mp_worker.py: skip the rest of the interpreter's teardown
