#!/usr/bin/env bash
# Round 7's last H200 call: where --device cuda's workers idle. convert_profile's unit trace (how many units
# run at once over the run, the drain after the last start, the longest units, journal writes, budget waits)
# for torch ops (default, twice) and the fused quantizer; then 8.1 GB against the safetensors copy with fsync
# (the conversion syncs its shards; the plain copy baseline does not).
#   OUT=/tmp/out bash benchmarks/round7_call7.sh
set -u
OUT=${OUT:-/tmp/r7-out}
source "$(dirname "$0")/gpu_steps.sh"
step build 120 "${BUILD_CHECKPOINT[@]}" /tmp/ck4 3
prof=(taskset -c 0-15 "${CONVERT_PROFILE[@]}" --src /tmp/ck4 --sample)
step trace_torch_1 40 "${prof[@]}" --out "$OUT/trace_torch_1.json"
step trace_fused 40 env PORTER_CUDA_QUANTIZE=fused "${prof[@]}" --out "$OUT/trace_fused.json"
step trace_torch_2 40 "${prof[@]}" --out "$OUT/trace_torch_2.json"
step convert_fsync 150 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors,copy-safetensors+fsync,copy-files --sizes 8 \
  --out "$OUT/convert_fsync.json"
for f in trace_torch_1 trace_fused trace_torch_2; do echo "== $f"; grep -v "^{" "$OUT/$f.log" | head -12; done
grep -h "warm " "$OUT/convert_fsync.log" | head
