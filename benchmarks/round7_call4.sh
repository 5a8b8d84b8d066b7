#!/usr/bin/env bash
# Round 7's fourth H200 call: the steady state of --device cuda with the fused quantizer vs torch ops, the
# one-time costs (CUDA context, the fused kernel's load) before the clock: convert_profile on one 3.2 GB
# real-dims checkpoint, the two variants interleaved, two rounds.
#   OUT=/tmp/out bash benchmarks/round7_call4.sh
set -u
OUT=${OUT:-/tmp/r7-out}
source "$(dirname "$0")/gpu_steps.sh"
step build 120 "${BUILD_CHECKPOINT[@]}" /tmp/ck4 3
prof=(taskset -c 0-15 "${CONVERT_PROFILE[@]}" --src /tmp/ck4 --sample)
for r in 1 2; do
  step profile_fused_$r 40 "${prof[@]}" --out "$OUT/profile_fused_$r.json"
  step profile_torch_$r 40 env PORTER_CUDA_QUANTIZE=torch "${prof[@]}" --out "$OUT/profile_torch_$r.json"
done
for f in profile_fused_1 profile_torch_1 profile_fused_2 profile_torch_2; do echo "== $f"; grep -v "^{" "$OUT/$f.log" | head -24; done
