#!/usr/bin/env bash
# H200 calls (round 10, MoE decode): the FP8 path on the one-token (NOSORT) layer with two e4m3 activation
# terms against W8A16 (FP8_DECODE 0): the rebased e4m3 weights straight into the fp8 MMA (1: activations
# the left operand, 2: weights the wgmma M side) or the MXFP8 weights as stored, one fp8 MMA per 32-group
# scaled into the fp32 accumulator (3: weights left, 4: activations left); then tiles. GPU tests first.
#   OUT=/tmp/out bash benchmarks/round10_moe_call1.sh
set -u
OUT=${OUT:-/tmp/r10-moe}
source "$(dirname "$0")/gpu_steps.sh"
step test_fp8_decode 240 python -m pytest -q -m gpu tests/test_triton_moe.py -k "fp8_decode"
grep -E "passed|failed|Error" "$OUT/test_fp8_decode.log" | tail -5
step ab 240 python benchmarks/moe_knob_ab.py --knob FP8_DECODE --values 0,2,3,4 --tokens 1,4 --rounds 3 --kernels \
  --out "$OUT/ab.json"
grep "^T=\|kernels" "$OUT/ab.log" | head -40
C="16,32,128,4,4,64,128,4,4,True,True,2;16,32,128,4,8,64,128,4,8,True,True,2;16,32,256,4,4,64,256,4,4,True,True,2"
C="$C;16,64,128,4,4,128,128,4,4,True,True,2;16,32,128,4,4,64,128,4,4,False,False,2;16,32,512,4,2,64,512,4,2,True,True,2"
step tiles 200 python benchmarks/moe_knob_ab.py --knob FP8_DECODE --values 3 --tokens 1 --rounds 3 --kernels --configs "$C" \
  --out "$OUT/tiles.json"
grep "^T=\|kernels" "$OUT/tiles.log" | head -40
