# The three values a Kubernetes Indexed Job would pass, for a one-pod job on this machine.
import os

from _distributed import free_port

os.environ.update(COORDINATOR=f"127.0.0.1:{free_port()}", WORLD_SIZE="1", JOB_COMPLETION_INDEX="0")
# <snippet>
assert jax.process_count() == 1 and jax.process_index() == 0
jax.distributed.shutdown()
