#!/usr/bin/env bash
# H200 call (round 17): --dry-run's memory estimate after it counts the C quantizer's own working memory
# (pipeline.NATIVE_WORK_BYTES_PER_ELEM) and copied ranges once (they live in the worker's read slab), against
# the measured peak on 16 cores; the same runs give the ratios to the copies again. STEPS picks (logs to $OUT):
#   est16     16 cores, 1.92 and 8.1 GB warm, CPU + cuda, one repeat, against the safetensors copy
#   cold16    16 cores, 3.16 GB from disk (page cache dropped before each run), CPU + cuda, two repeats, against
#             the safetensors copy, shutil.copyfile and shutil.copyfile + fsync of every output
#   cold8     16 cores, 8.1 GB from disk (page cache dropped before each run), CPU + cuda, two repeats, the same
#             copies: whether the GPU path's fixed start (CUDA context, pinned slabs) is what puts 3.16 GB past 1.2x
#   shm8      16 cores, 8.1 GB with the checkpoint and the output in /dev/shm (a whole conversion, no disk under
#             its writes), CPU + cuda, two repeats, against the safetensors copy
#   startab   --device cuda with the parts that are ready before the CUDA context quantized on the CPU (the
#             default) against PORTER_CUDA_CPU_START=0 (they wait for it): 16 cores, 1.92 and 8.1 GB, checkpoint
#             and output in /dev/shm, two repeats; then 3.16 GB from disk, two repeats
#   estgpu    after unit_costs counts a builder's copy only where the builder makes one (builder_copies) and the
#             CPU-start part's memory: --device cuda, 16 cores, 1.92 and 8.1 GB in /dev/shm, then the release
#             structure in /dev/shm (8 s): --dry-run's estimate against the peak
#   sparseshm the release structure (sparse_checkpoint.py, 16 cores), checkpoint and output in /dev/shm, 8 s each,
#             CPU then cuda
#   conv2     2 cores (taskset -c 0,1), 1.92 GB warm, CPU + cuda, five repeats, against the safetensors copy
#             and shutil.copyfile
#   gputests  the GPU tests of conversion and verify (--device cuda bit-identical to the CPU over every shard)
# The H200 image has no xxhash: the call carries its wheel in .whl (see benchmarks/results/convert_round15.md).
#   OUT=/tmp/out STEPS="est16 cold16 sparseshm conv2 gputests" bash benchmarks/round17_call.sh   (call 1)
#   OUT=/tmp/out STEPS="cold8" bash benchmarks/round17_call.sh                                     (call 2)
#   OUT=/tmp/out STEPS="shm8" bash benchmarks/round17_call.sh                                      (call 3)
#   OUT=/tmp/out STEPS="gputests startab conv2" bash benchmarks/round17_call.sh                    (call 4)
#   OUT=/tmp/out STEPS="estgpu" bash benchmarks/round17_call.sh                                    (call 5)
set -u
OUT=${OUT:-/tmp/r17}
STEPS=${STEPS:-est16}
source "$(dirname "$0")/gpu_steps.sh"
carried_wheels
nproc >> "$OUT/gpu.txt"
if has est16; then
  step est16 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --copies copy-safetensors --sizes 2,8 \
    --out "$OUT/est16.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/est16.log" | cut -c1-250
fi
if has cold16; then
  step cold16 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --cache cold --repeats 2 \
    --copies copy-safetensors,copy-files,copy-files+fsync --sizes 4 --out "$OUT/cold16.json"
  grep -h "cold convert\|cold copy\|GB (" "$OUT/cold16.log" | cut -c1-250
fi
if has cold8; then
  step cold8 400 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --cache cold --repeats 2 \
    --copies copy-safetensors,copy-files,copy-files+fsync --sizes 8 --out "$OUT/cold8.json"
  grep -h "cold convert\|cold copy\|GB (" "$OUT/cold8.log" | cut -c1-250
fi
if has shm8; then
  df -h /dev/shm >> "$OUT/gpu.txt"
  step shm8 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --copies copy-safetensors --sizes 8 \
    --repeats 2 --tmp /dev/shm --out "$OUT/shm8.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/shm8.log" | cut -c1-250
fi
if has startab; then
  step startab 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --variants "wait:PORTER_CUDA_CPU_START=0" \
    --copies copy-safetensors --sizes 2,8 --repeats 2 --tmp /dev/shm --out "$OUT/startab.json"
  grep -h "warm convert\|warm copy\|GB (" "$OUT/startab.log" | cut -c1-230
  step startab_cold 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --variants "wait:PORTER_CUDA_CPU_START=0" \
    --cache cold --copies copy-safetensors,copy-files+fsync --sizes 4 --repeats 2 --out "$OUT/startab_cold.json"
  grep -h "cold convert\|cold copy\|GB (" "$OUT/startab_cold.log" | cut -c1-230
fi
if has estgpu; then
  step estgpu 240 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --copies "" --sizes 2,8 --tmp /dev/shm \
    --out "$OUT/estgpu.json"
  grep -h "warm convert\|GB (" "$OUT/estgpu.log" | cut -c1-250
  step estgpu_sparse 150 taskset -c 0-15 python benchmarks/sparse_checkpoint.py --seconds 8 --device cuda \
    --tmp /dev/shm --out "$OUT/estgpu_sparse.json"
  tail -n 1 "$OUT/estgpu_sparse.log"
fi
if has sparseshm; then
  sparseshm_runs
fi
if has conv2; then
  conv2_runs
fi
if has gputests; then
  step gputests 300 "${CONVERSION_GPU_TESTS[@]}"
  tail -n 3 "$OUT/gputests.log"
fi
pack r17
