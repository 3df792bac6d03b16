#!/usr/bin/env bash
# The GPU check, in one call on a machine with one GPU (H100 or H200, CUDA jaxlib installed),
# sized for a short loan (one call of at most 560 s: each step below has its own timeout,
# AOT_TIMEOUT, MEMORY_TIMEOUT and RUN_TIMEOUT), most needed first:
#   1. `overlap-ckpt aot --target gpu --measure`: the 1B LM's plain step and its K=1, K=3 and
#      K=4 window phases (K=3: what window="auto" picks for it on an H100) compiled for the
#      real device (same report as the compile-only benchmarks/results/aot_h100_1b.md), run
#      beside the prediction, with a profiler trace of the plain step and each K's largest
#      phase (when does each copy run?) taken before Orbax's saves;
#   2. `benchmarks.bench_host_memory` on the 20M LM, K=1 and K=3: where a checkpoint's host
#      memory goes on a GPU (the 100M LM's K=3 peak RSS is 2.15x the state there, its budget
#      1.5x; the 20M LM compiles in a fraction of the 100M's 50 s, and the parts are ratios);
#   3. `benchmarks.run` on the 100M LM: the managers end to end (capture, host replay,
#      persist) against stock Orbax async, at a checkpoint every 10 steps (K=1 and K=3;
#      window="auto" chose K=1 there on both H200 loans).
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

timeout "${AOT_TIMEOUT:-260}" $py -m overlap_ckpt.tools.cli aot --target gpu --model 1b --batch-per-device 16 \
    --k 1 3 4 --measure --profile /tmp/gpu_check_profile --output "$out/aot_gpu_1b.md" > /dev/null 2> "$out/aot_gpu_1b.log"
echo "aot: exit $?"
tail -n 12 "$out/aot_gpu_1b.log"
# the trace as one file (a loan returns few files); read it with jax.profiler.ProfileData
[ -d /tmp/gpu_check_profile ] && tar czf "$out/profile.tgz" -C /tmp gpu_check_profile

JAX_PLATFORMS=cuda,cpu timeout "${MEMORY_TIMEOUT:-140}" $py -m benchmarks.bench_host_memory --model 20m \
    --batch-size 8 --windows 1 3 --out "$out/gpu_20m_host_memory" > "$out/gpu_20m_host_memory.log" 2>&1
echo "host memory: exit $?"
[ -f "$out/gpu_20m_host_memory.md" ] && cat "$out/gpu_20m_host_memory.md"

timeout "${RUN_TIMEOUT:-160}" $py -m benchmarks.run --model 100m --platform gpu --batch-size 32 --intervals 10 \
    --steps 40 --configs orbax_async overlap_k1 overlap_k3 --restore-repeats 1 --raw-repeats 1 \
    --compile-cache --timeout 150 --out "$out/gpu_100m" > "$out/gpu_100m.log" 2>&1
echo "run: exit $?"
tail -n 25 "$out/gpu_100m.log"
[ -f "$out/gpu_100m.md" ] && cat "$out/gpu_100m.md"
[ -f "$out/aot_gpu_1b.md" ] && sed -n '/## Programs/,$p' "$out/aot_gpu_1b.md"
