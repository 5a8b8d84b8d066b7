#!/usr/bin/env bash
# H200 call (round 10, MoE decode, 2): W8A16 on the rebased weights (W8A16_REBASED: e4m3 -> fp16 only, one
# scale per row after the K loop) against W8A16 on the weights as stored, decode to small prefill, with
# per-kernel times; the FP8 decode path (FP8_DECODE 2) beside both. GPU tests first. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round10_moe_call2.sh
set -u
OUT=${OUT:-/tmp/r10-moe2}
source "$(dirname "$0")/gpu_steps.sh"
step tests 240 python -m pytest -q -m gpu tests/test_triton_moe.py -k "fp8_decode or rebased"
grep -E "passed|failed|Error" "$OUT/tests.log" | tail -5
step ab 300 python benchmarks/moe_knob_ab.py --knob W8A16_REBASED --values False,True --tokens 1,4,16,64,256 \
  --rounds 3 --kernels --out "$OUT/ab.json"
grep "^T=\|kernels" "$OUT/ab.log" | head -40
step ab_fp8 200 python benchmarks/moe_knob_ab.py --knob FP8_DECODE --values 0,2 --tokens 1,4 --rounds 3 \
  --out "$OUT/ab_fp8.json"
grep "^T=" "$OUT/ab_fp8.log" | head -10
