#!/usr/bin/env bash
# H200 calls (round 13). STEPS picks what one call runs (logs to $OUT):
#   idle      benchmarks/moe_idle_probe.py: why the MXFP8 layer pays more than its bf16 twin for an idle-GPU
#             graph replay at T = 4 and 16 (interleaved idle / queued timings, host replay cost, PDL off,
#             kernel trace)
#   layer     the MoE layer table (T = 1..4096), the layer and its bf16 twin timed in interleaved rounds
#   convshm   16 cores, 8.1 GB, CPU + cuda, with the bytes floor (convert_floor.py): the checkpoint and every
#             output on this machine's disk, then all of it in /dev/shm (no disk under the writes), in one call
#   jfsync    (needs commit 7345496: the knob was taken out again after this measurement) 16 cores,
#             8.1 GB on this disk: the shard journal written with and without its fsync (PORTER_JOURNAL_FSYNC=0),
#             CPU + cuda, two repeats; the CPU path's 16-core profile both ways
#   cold      16 cores, 8.1 GB from this machine's disk (page cache dropped before each run), CPU + cuda,
#             against the safetensors copy and shutil.copyfile, two repeats
#   durable   16 cores, 8.1 GB, warm and cold, CPU + cuda, against shutil.copyfile with and without fsync
#   sparse    benchmarks/sparse_checkpoint.py on 16 cores (MiniMax-M3's real 59-shard structure as sparse
#             files), 20 s each with the CPU path and --device cuda, output on this machine's disk
#   OUT=/tmp/out STEPS="idle convshm" bash benchmarks/round13_call.sh
set -u
OUT=${OUT:-/tmp/r13}
STEPS=${STEPS:-idle}
source "$(dirname "$0")/gpu_steps.sh"
if has idle; then
  step idle_probe 300 python benchmarks/moe_idle_probe.py --tokens 1,4,16,64 --out "$OUT/idle_probe.json"
  grep -E "^T=" "$OUT/idle_probe.log" | head -60
fi
if has layer; then
  step layer 420 python benchmarks/moe_layer.py --out "$OUT" --tag _round13 --tokens 1,4,16,64,256,512,1024,4096
  grep -E "^T=|GPU|bandwidth" "$OUT/layer.log" | cut -c1-200 | head -30
fi
if has convshm; then
  { lscpu | grep -i "model name"; df -h /dev/shm "$PWD"; } >> "$OUT/gpu.txt" 2>&1
  step convdisk_16c_8 220 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --floor \
    --copies copy-safetensors,copy-safetensors+fsync,copy-files --sizes 8 --out "$OUT/convdisk_16c_8.json"
  step convshm_16c_8 220 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --floor --tmp /dev/shm \
    --copies copy-safetensors,copy-safetensors+fsync,copy-files --sizes 8 --out "$OUT/convshm_16c_8.json"
  grep -h "warm convert\|warm copy\|GB checkpoint\|GB/s" "$OUT"/conv*_16c_8.log | cut -c1-180 | head -60
fi
if has jfsync; then
  step jfsync_16c_8 300 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --repeats 2 \
    --variants "nojfsync:PORTER_JOURNAL_FSYNC=0" --copies copy-safetensors,copy-files --sizes 8 --out "$OUT/jfsync_16c_8.json"
  step build_8 60 "${BUILD_CHECKPOINT[@]}" /tmp/r13src8 7
  for v in 1 0; do
    step profile_16c_j$v 60 env PORTER_JOURNAL_FSYNC=$v taskset -c 0-15 python benchmarks/convert_profile.py --device cpu \
      --max-shard-size 512MB --src /tmp/r13src8 --out "$OUT/profile_16c_j$v.json"
  done
  grep -h "warm convert\|warm copy\|GB checkpoint" "$OUT"/jfsync_*.log | cut -c1-200
  for v in 1 0; do grep -E "cpu:|core-s|journal|wall" "$OUT/profile_16c_j$v.log" | cut -c1-200 | head -20; done
fi
if has cold; then
  step cold_16c_8 420 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --cache cold --repeats 2 \
    --copies copy-safetensors,copy-files --sizes 8 --out "$OUT/cold_16c_8.json"
  grep -h "cold convert\|cold copy\|GB checkpoint" "$OUT"/cold_16c_8.log | cut -c1-220
fi
if has durable; then
  step durable_16c_8 420 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda --cache warm,cold \
    --copies copy-safetensors,copy-files,copy-files+fsync --sizes 8 --out "$OUT/durable_16c_8.json"
  grep -h "convert\|copy\|GB checkpoint" "$OUT"/durable_16c_8.log | grep -v "^{" | cut -c1-240
fi
if has sparse; then
  sparse_runs
fi
pack r13
