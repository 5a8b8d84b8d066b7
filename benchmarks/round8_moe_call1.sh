#!/usr/bin/env bash
# H200 call (round 8, MoE prefill): what bounds the FP8 path at T=1024/4096 (moe_prefill_floor: padding and
# torch._scaled_mm on the same two-term work), then an A/B of the grid order in groups of BM blocks (group_m)
# and FP8 tiles with the weights as wgmma's M side (swap, which also allows BM 32) with per-kernel times;
# then the MoE GPU tests (new: test_grouped_order_and_swapped_fp8_tiles). Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round8_moe_call1.sh
# Ran at d4a5d14 (benchmarks/results/moe_round8_call1_*). Neither group_m nor the FP8 swap beat the plain
# tiles, so both were removed after this call: at later commits the ab step fails on the 13-field configs.
set -u
OUT=${OUT:-/tmp/r8-moe}
source "$(dirname "$0")/gpu_steps.sh"
step floor 120 python benchmarks/moe_prefill_floor.py --tokens 1024,4096
grep "^T=" "$OUT/floor.log"
C="64,64,128,4,3,128,128,4,3,False,False,2,1;64,64,128,4,3,128,128,4,3,False,False,2,4"
C="$C;64,64,128,4,3,128,128,4,3,False,False,2,8;64,64,128,4,4,128,128,4,4,False,False,2,4"
C="$C;64,64,128,4,3,128,128,4,3,True,True,2,4;32,64,128,4,3,128,128,4,3,True,True,2,4"
C="$C;32,128,128,8,3,256,128,8,3,True,True,2,4;64,128,128,8,3,256,128,8,3,True,True,2,4"
step ab 300 python benchmarks/moe_knob_ab.py --knob FP8_ROW_SCALE --values True --tokens 4096,1024 --rounds 3 \
  --kernels --configs "$C" --out "$OUT/ab.json"
grep "^T=\|kernels\|rror" "$OUT/ab.log" | head -60
step tests 150 python -m pytest -q -m gpu tests/test_triton_moe.py
tail -3 "$OUT/tests.log"
