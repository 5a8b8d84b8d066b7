#!/usr/bin/env bash
# H200 calls (round 16): conversion from disk against copies whose writes reach the disk too, the disk's own
# durable write rate (the floor under --device cuda once the page cache stops absorbing the output), and the
# 2-core warm ratio over more repeats. STEPS picks what one call runs (logs to $OUT):
#   diskw     benchmarks/disk_write_rate.py: 24 GB by 8 threads into this machine's disk, per-2 s rates and durable
#   cold16    16 cores, 3.16 GB from disk (page cache dropped before each run), CPU + cuda, two repeats, against
#             the safetensors copy, shutil.copyfile and shutil.copyfile + fsync of every output
#   coldprof  16 cores, 3.16 GB from disk: convert_profile.py --cold (where the time goes), CPU and cuda
#   sparseshm the release structure (sparse_checkpoint.py, 16 cores) with the checkpoint and its output in /dev/shm,
#             8 s each, CPU then cuda: the pipeline's own rate with no disk under the writes
#   conv2     2 cores (taskset -c 0,1), 1.92 GB warm, CPU + cuda, five repeats, against the safetensors copy
#             and shutil.copyfile
#   warmup    the CUDA init thread also quantizing one block per source dtype (kernels loaded before the workers'
#             first parts) against PORTER_CUDA_WARMUP=0: --device cuda, 2 cores warm (1.92 GB, five repeats) and
#             16 cores from disk (3.16 GB, two repeats), then convert_profile.py --cold --device cuda with it on
#             (measured in call 3, no difference, taken out again: the switch exists only at commit 92a033e)
#   gputests  the GPU tests of conversion and verify (--device cuda bit-identical to the CPU over every shard)
#   estcuda   with CUDA_CONTEXT_BYTES at the measured 400 MiB (benchmarks/cuda_context_rss.py): --device cuda on 16
#             cores, 2 GB warm and the release structure (sparse, 10 s): --dry-run's estimate against the peak
#   lanes     the C quantizer with grouped (transposed) reductions: quantize_native_lanes.py on 2 threads (8 and 16
#             lanes, GB/s per core), then the CPU quantizer tests on this AVX-512 CPU
#   conv16    16 cores, 8 GB warm, CPU + cuda, one repeat, against the safetensors copy (after the quantizer change)
# The H200 image has no xxhash: the call carries its wheel in .whl (see benchmarks/results/convert_round15.md).
#   OUT=/tmp/out STEPS="diskw cold16 coldprof conv2" bash benchmarks/round16_call.sh
set -u
OUT=${OUT:-/tmp/r16}
STEPS=${STEPS:-conv2}
source "$(dirname "$0")/gpu_steps.sh"
carried_wheels
nproc >> "$OUT/gpu.txt"; df -h "$PWD" >> "$OUT/gpu.txt"; cat /proc/sys/vm/dirty_ratio /proc/sys/vm/dirty_background_ratio >> "$OUT/gpu.txt"
if has diskw; then
  step diskw 200 python benchmarks/disk_write_rate.py --dir "$PWD/benchmarks" --gb 24 --threads 8 --out "$OUT/diskw.json"
  cat "$OUT/diskw.log"
fi
if has cold16; then
  step cold16 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --cache cold --repeats 2 \
    --copies copy-safetensors,copy-files,copy-files+fsync --sizes 4 --out "$OUT/cold16.json"
  grep -h "cold convert\|cold copy\|GB (" "$OUT/cold16.log" | cut -c1-230
fi
if has coldprof; then
  step build_3 120 "${BUILD_CHECKPOINT[@]}" "$PWD/benchmarks/r16src3" 3
  for d in cpu cuda; do
    step coldprof_$d 120 taskset -c 0-15 python benchmarks/convert_profile.py --device $d --max-shard-size 512MB \
      --src "$PWD/benchmarks/r16src3" --cold --tmp "$PWD/benchmarks" --out "$OUT/coldprof_$d.json"
    grep -E "GB,|wall|journal|core-s" "$OUT/coldprof_$d.log" | cut -c1-200 | head -16
  done
  rm -rf "$PWD/benchmarks/r16src3"
fi
if has sparseshm; then
  sparseshm_runs
fi
if has conv2; then
  conv2_runs
fi
if has warmup; then
  step warmup2 300 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --variants "nowarm:PORTER_CUDA_WARMUP=0" \
    --copies copy-safetensors --sizes 2 --repeats 5 --out "$OUT/warmup2.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/warmup2.log" | cut -c1-130
  step warmupcold 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --variants "nowarm:PORTER_CUDA_WARMUP=0" --cache cold \
    --copies copy-safetensors,copy-files+fsync --sizes 4 --repeats 2 --out "$OUT/warmupcold.json"
  grep -h "cold convert\|cold copy\|GB (" "$OUT/warmupcold.log" | cut -c1-130
  step build_3w 120 "${BUILD_CHECKPOINT[@]}" "$PWD/benchmarks/r16src3w" 3
  step coldprof_warmup 120 taskset -c 0-15 python benchmarks/convert_profile.py --device cuda --max-shard-size 512MB \
    --src "$PWD/benchmarks/r16src3w" --cold --tmp "$PWD/benchmarks" --out "$OUT/coldprof_warmup.json"
  grep -E "GB,|wall|units|core-s" "$OUT/coldprof_warmup.log" | cut -c1-200 | head -12
  rm -rf "$PWD/benchmarks/r16src3w"
fi
if has gputests; then
  step gputests 300 "${CONVERSION_GPU_TESTS[@]}"
  tail -n 3 "$OUT/gputests.log"
fi
if has estcuda; then
  step estcuda 200 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --copies copy-safetensors --sizes 2,8 --out "$OUT/estcuda.json"
  grep -h "warm convert\|GB (" "$OUT/estcuda.log" | cut -c1-250
  step sparse_est_cuda 150 taskset -c 0-15 python benchmarks/sparse_checkpoint.py --seconds 10 --device cuda \
    --out "$OUT/sparse_est_cuda.json"
  tail -n 1 "$OUT/sparse_est_cuda.log"
fi
if has lanes; then
  grep -o -m1 "avx512f" /proc/cpuinfo >> "$OUT/gpu.txt"
  step lanes2 120 taskset -c 0,1 python benchmarks/quantize_native_lanes.py --threads 2 --out "$OUT/lanes2.json"
  step cputests 200 "${CPU_QUANTIZER_TESTS[@]}"
  cat "$OUT/lanes2.log"; tail -n 2 "$OUT/cputests.log"
fi
if has conv16; then
  step conv16 140 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --copies copy-safetensors --sizes 8 \
    --out "$OUT/conv16.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/conv16.log" | cut -c1-200
fi
pack r16
