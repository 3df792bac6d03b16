#!/usr/bin/env bash
# The GPU check, in one call on a machine with one GPU (H100 or H200, CUDA jaxlib installed),
# sized for a short loan (one call of at most 560 s: each step below has its own timeout,
# MEMORY_TIMEOUT, SCHEDULE_TIMEOUT and AOT_TIMEOUT), most needed first:
#   1. `benchmarks.bench_host_memory` on the 20M LM, K=1 and K=3: where a checkpoint's host
#      memory goes on a GPU (84 s on the H200 of 2026-11-26: results/gpu_h200_20m_host_memory.md);
#   2. `benchmarks.bench_copy_schedule` on the 1B LM, the last phase of K=1 and K=3: where XLA
#      starts the window's host copy, and the step with the copy started at the top (139 s
#      there: results/gpu_h200_1b_copy_schedule.md);
#   3. `overlap-ckpt aot --target gpu --measure`: the 1B LM's plain step and its K=1, K=3 and
#      K=4 window phases compiled for the real device, run beside the prediction, with a
#      profiler trace of the plain step and each K's largest phase (read it with
#      `python -m benchmarks.trace_copies`), then `jax.device_get` of the state and stock
#      Orbax's save (the last two are cut off first: the whole step took over 260 s there).
# `benchmarks.run` against stock Orbax is a call of its own (the 100M LM took 120 s to reach
# its third configuration), and so is its K=1 run beside K=1 with the copy schedule hint
# (`--configs overlap_k1 overlap_k1_hint`, 276 s on the 100M LM; add `--profile DIR` to trace
# the steps after a window, where most of a checkpoint's cost was): see benchmarks/README.md.
# JAX_PLATFORMS names the CPU too: windows of K > 1 are replayed with JAX's CPU backend.
# Usage: bash benchmarks/gpu_check.sh OUT_DIR   (from the repository root). It writes more
# files than a loan returns (8): give it a scratch directory, then archive it into $OUT,
# the profile apart (`mv DIR/profile.tgz $OUT/; tar czf $OUT/gpu_check.tgz -C DIR .`).
set -u
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  echo "cpus: $(nproc)"; free -g | head -2; df -h /tmp | tail -1
  $py -c "from importlib.metadata import version
import jax
print(*(f'{n} {version(n)}' for n in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'tensorstore', 'numpy')))
print(jax.devices())"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

export JAX_PLATFORMS=cuda,cpu

timeout "${MEMORY_TIMEOUT:-120}" $py -m benchmarks.bench_host_memory --model 20m \
    --batch-size 8 --windows 1 3 --out "$out/gpu_20m_host_memory" > "$out/gpu_20m_host_memory.log" 2>&1
echo "host memory: exit $?"
[ -f "$out/gpu_20m_host_memory.md" ] && cat "$out/gpu_20m_host_memory.md"

timeout "${SCHEDULE_TIMEOUT:-170}" $py -m benchmarks.bench_copy_schedule --target gpu \
    --model 1b --batch-per-device 16 --k 1 3 --out "$out/gpu_1b_copy_schedule" > "$out/gpu_1b_copy_schedule.log" 2>&1
echo "copy schedule: exit $?"
[ -f "$out/gpu_1b_copy_schedule.md" ] && cat "$out/gpu_1b_copy_schedule.md"

timeout "${AOT_TIMEOUT:-260}" $py -m overlap_ckpt.tools.cli aot --target gpu --model 1b --batch-per-device 16 \
    --k 1 3 4 --measure --profile /tmp/gpu_check_profile --output "$out/aot_gpu_1b.md" > /dev/null 2> "$out/aot_gpu_1b.log"
echo "aot: exit $?"
tail -n 16 "$out/aot_gpu_1b.log"
# the trace as one file (a loan returns few files); read it with benchmarks.trace_copies
[ -d /tmp/gpu_check_profile ] && tar czf "$out/profile.tgz" -C /tmp gpu_check_profile
[ -f "$out/aot_gpu_1b.md" ] && sed -n '/## Programs/,$p' "$out/aot_gpu_1b.md"
