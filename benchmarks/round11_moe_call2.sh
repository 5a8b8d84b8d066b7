#!/usr/bin/env bash
# (ONE_TOKEN_X was measured no faster and not kept, so it was never committed and this script no longer runs;
#  results: benchmarks/results/moe_round11_call2_one_token_ab.log.)
# H200 call (round 11, 2): ONE_TOKEN_X (GEMM1 reads the one-token hidden row itself: no prep launch; 1 bf16
# MMA, 2 its own fp16 prescale) - the MoE GPU tests, then the one-token A/B on the whole layer at
# MiniMax-M3 dims with per-kernel times. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round11_moe_call2.sh
set -u
OUT=${OUT:-/tmp/r11-moe2}
source "$(dirname "$0")/gpu_steps.sh"
step moe_tests 240 python -m pytest -q -m gpu tests/test_triton_moe.py
grep -E "passed|failed|^FAILED|^E  " "$OUT/moe_tests.log" | head -16
step one_token_ab 240 python benchmarks/moe_knob_ab.py --knob ONE_TOKEN_X --values 0,1,2 --tokens 1 --rounds 7 --kernels --out "$OUT"
grep -E "^T=|kernels|streaming" "$OUT/one_token_ab.log" | head -40
for v in 0 1 2; do
  step layer_x$v 120 env PORTER_MOE_ONE_TOKEN_X=$v python benchmarks/moe_layer.py --out "$OUT" --tokens 1 --tag _round11_x$v
  grep -E "^T=" "$OUT/layer_x$v.log" | head -3
done
