# A one-task SLURM job on this machine: the variables srun sets, with the coordinator
# port (derived by JAX from the job id) free.
import os

from _distributed import check_store, free_port, shared_dir

port = free_port(65535 - 2**12 + 1)
os.environ.update(SLURM_JOB_ID=str(port - (65535 - 2**12 + 1)), SLURM_NTASKS="1", SLURM_PROCID="0",
                  SLURM_LOCALID="0", SLURM_STEP_NODELIST="localhost", SLURM_STEP_NUM_NODES="1")
ckpt_root = shared_dir()
# <snippet>
assert jax.process_count() == 1
check_store(store)
store.close()
jax.distributed.shutdown()
