#!/usr/bin/env bash
# Round 7's last H200 call: the GPU section of --device cuda split into its steps (convert_profile: Tensor.to,
# copy_ to pinned host, slab registration, the fused launches, the final sync), torch ops and fused.
#   OUT=/tmp/out bash benchmarks/round7_call8.sh
set -u
OUT=${OUT:-/tmp/r7-out}
source "$(dirname "$0")/gpu_steps.sh"
step build 120 "${BUILD_CHECKPOINT[@]}" /tmp/ck4 3
prof=(taskset -c 0-15 "${CONVERT_PROFILE[@]}" --src /tmp/ck4)
step split_torch 40 "${prof[@]}" --out "$OUT/split_torch.json"
step split_fused 40 env PORTER_CUDA_QUANTIZE=fused "${prof[@]}" --out "$OUT/split_fused.json"
for f in split_torch split_fused; do echo "== $f"; grep -v "^{" "$OUT/$f.log" | head -30; done
