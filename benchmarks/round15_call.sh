#!/usr/bin/env bash
# H200 calls (round 15): conversion with XXH3-128 chunk digests (the default) against sha256 chunks
# (`--digest sha256`, the rule before), each pair in one run. STEPS picks what one call runs (logs to $OUT):
#   gputests  the GPU tests of conversion and verify: --device cuda bit-identical to the CPU over every shard
#   conv16    16 cores, 2 and 8 GB, CPU + cuda, xxh3-128 and sha256 digests, against the safetensors copy and
#             shutil.copyfile (output on this machine's disk)
#   shm16     the same at 8 GB with the checkpoint and every output in /dev/shm (no disk under the writes)
#   conv2     2 cores (taskset -c 0,1), 1.92 GB, CPU + cuda, both digests, two repeats
#   workers2  2 cores, 1.92 GB, CPU + cuda, 2 (the default), 3 and 4 workers, three repeats: whether a worker more
#             than cores hides the time workers block (journal fsync, budget waits)
#   final     with the default now cores + 1: 2 cores, 1.92 GB, default (3) against WORKERS=2, three repeats; 16
#             cores, 2 and 8 GB, default (17) against WORKERS=16; CPU + cuda
#   tests     the final tree: the conversion and verify GPU tests, and the CPU quantizer tests on this AVX-512 CPU
#   cold      16 cores, 4 GB from this machine's disk (page cache dropped before each run), CPU + cuda, against
#             the safetensors copy and shutil.copyfile, one repeat
#   profile2  2 cores, CPU path, core-seconds per stage (convert_profile.py), both digests
#   lanes     benchmarks/quantize_native_lanes.py: the C quantizer at 8 and 16 lanes on this CPU (1 and 2
#             threads, and 16), then its CPU tests with porter's own build (16 lanes where AVX-512F)
#   sparse    benchmarks/sparse_checkpoint.py on 16 cores (MiniMax-M3's real 59-shard structure as sparse
#             files), 20 s each with the CPU path and --device cuda
# The H200 image has no xxhash: the call carries its wheel in .whl (see benchmarks/results/convert_round15.md).
#   OUT=/tmp/out STEPS="gputests conv16 conv2 profile2" bash benchmarks/round15_call.sh
set -u
OUT=${OUT:-/tmp/r15}
STEPS=${STEPS:-conv2}
source "$(dirname "$0")/gpu_steps.sh"
carried_wheels
BOTH=(--variants "sha256:DIGEST=sha256" --copies copy-safetensors,copy-files)
if has lanes; then
  grep -o -m1 "avx512f" /proc/cpuinfo >> "$OUT/gpu.txt"; lscpu | grep -i "model name" >> "$OUT/gpu.txt"
  step lanes2 120 taskset -c 0,1 python benchmarks/quantize_native_lanes.py --threads 2 --out "$OUT/lanes2.json"
  step lanes16 120 taskset -c 0-15 python benchmarks/quantize_native_lanes.py --threads 16 --out "$OUT/lanes16.json"
  step cputests 200 "${CPU_QUANTIZER_TESTS[@]}"
  cat "$OUT/lanes2.log" "$OUT/lanes16.log"; tail -n 2 "$OUT/cputests.log"
fi
if has gputests; then
  step gputests 300 "${CONVERSION_GPU_TESTS[@]}"
  tail -n 3 "$OUT/gputests.log"
fi
if has conv16; then
  step conv16 330 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda "${BOTH[@]}" --sizes 2,8 \
    --out "$OUT/conv16.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/conv16.log" | cut -c1-200
fi
if has shm16; then
  step shm16 200 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda "${BOTH[@]}" --sizes 8 --tmp /dev/shm \
    --out "$OUT/shm16.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/shm16.log" | cut -c1-200
fi
if has conv2; then
  step conv2 300 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda "${BOTH[@]}" --sizes 2 --repeats 2 \
    --out "$OUT/conv2.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/conv2.log" | cut -c1-200
fi
if has workers2; then
  step workers2 300 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --variants "w3:WORKERS=3;w4:WORKERS=4" \
    --copies copy-safetensors,copy-files --sizes 2 --repeats 3 --out "$OUT/workers2.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/workers2.log" | cut -c1-200
fi
if has cold; then
  step cold16 240 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --cache cold \
    --copies copy-safetensors,copy-files --sizes 4 --out "$OUT/cold16.json"
  grep -h "cold convert\|cold copy\|GB (" "$OUT/cold16.log" | cut -c1-200
fi
if has tests; then
  step finaltests 400 python -m pytest -q tests/test_mxfp8_native.py tests/test_mxfp8.py tests/test_tensor_digest.py \
    -p no:cacheprovider
  step finalgputests 300 "${CONVERSION_GPU_TESTS[@]}"
  tail -n 2 "$OUT/finaltests.log" "$OUT/finalgputests.log"
fi
if has final; then
  step final2 300 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --variants "w2:WORKERS=2" \
    --copies copy-safetensors,copy-files --sizes 2 --repeats 3 --out "$OUT/final2.json"
  step final16 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --variants "w16:WORKERS=16" \
    --copies copy-safetensors,copy-files --sizes 2,8 --out "$OUT/final16.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/final2.log" "$OUT/final16.log" | cut -c1-150
fi
if has profile2; then
  step build_2 120 taskset -c 0,1 "${BUILD_CHECKPOINT[@]}" /tmp/r15src2 2
  for d in xxh3-128 sha256; do
    step profile2_$d 90 taskset -c 0,1 python benchmarks/convert_profile.py --device cpu --max-shard-size 512MB \
      --src /tmp/r15src2 --digest $d --out "$OUT/profile2_$d.json"
    grep -E "core-s|wall|digest|quantize|pread|pwrite" "$OUT/profile2_$d.log" | cut -c1-160 | head -14
  done
fi
if has sparse; then
  sparse_runs
fi
pack r15
