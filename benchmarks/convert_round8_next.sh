#!/usr/bin/env bash
# Prepared at the end of round 7, ran as round 8's call 2 (benchmarks/results/convert_round8.md; PORTER_SLAB_REGISTER
# was removed after round 8, so the early variant now runs the default). Is --device cuda's end-to-end rate a fixed
# cost of the first wave of units plus a steady state, and what is that steady state? (round 7's traces: the
# 8 longest expert units, 0.74-1.49 s each against a mean of ~0.3 s for the rest, all start in the first 0.43 s;
# benchmarks/results/convert_round7.md). (1) 8 and 24 GB on 16 cores in one run: the seconds per GB between
# them is the steady state, the intercept the fixed cost; each size also with PORTER_SLAB_REGISTER=early (every
# worker's pinned slabs registered before any GPU work instead of in the first wave's launches: does the fixed
# cost shrink?); (2) convert_profile's steady-state rate (between the first wave and the drain) on a 24 GB
# checkpoint: torch ops, fused, and torch ops with early registration (its first_wave_end_s and the first
# wave's expert units against steady_torch's). Step timeouts add up to 560 s (one device call: 600 s);
# expected ~150 s for (1) (round 7 call 5: ~7.5 s per 8 GB run, 5 runs per size) and ~20 s per profile.
#   OUT=/tmp/out bash benchmarks/convert_round8_next.sh
set -u
OUT=${OUT:-/tmp/r8-out}
source "$(dirname "$0")/gpu_steps.sh"
step convert_16c 290 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors,copy-files --sizes 8,24 \
  --variants "fused@cuda:PORTER_CUDA_QUANTIZE=fused;early@cuda:PORTER_SLAB_REGISTER=early" \
  --out "$OUT/convert_16c.json"
step build 90 "${BUILD_CHECKPOINT[@]}" /tmp/ck24 20
prof=(taskset -c 0-15 "${CONVERT_PROFILE[@]}" --src /tmp/ck24)
step steady_torch 60 "${prof[@]}" --out "$OUT/steady_torch.json"
step steady_fused 60 env PORTER_CUDA_QUANTIZE=fused "${prof[@]}" --out "$OUT/steady_fused.json"
step steady_early 60 env PORTER_SLAB_REGISTER=early "${prof[@]}" --out "$OUT/steady_early.json"
grep -h "warm \|steady\|first wave" "$OUT"/*.log | grep -v "^{" | head -40
