#!/usr/bin/env bash
# H200 call (round 11, 1): the experts rebased at load (the default): every GPU test (MoE kernels, runtime,
# end to end, convert, verify), then the one-token tile sweep on the rebased weights
# (benchmarks/moe_decode_sweep.py, GEMM1 BK 512 / BN 64 / 4 stages / 2 warps and GEMM2 BN 32 / BK 512 / 2 warps
# added). Logs to $OUT.   STEPS="tests sweep" (default both)
#   OUT=/tmp/out bash benchmarks/round11_moe_call1.sh
set -u
OUT=${OUT:-/tmp/r11-moe1}
STEPS=${STEPS:-tests sweep}
source "$(dirname "$0")/gpu_steps.sh"
if [[ $STEPS == *tests* ]]; then
  step gpu_tests 560 python -m pytest -q -m gpu tests/test_triton_moe.py tests/test_mxfp8_triton.py tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py tests/test_convert.py tests/test_verify_gpu.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.log" | head -16
fi
if [[ $STEPS == *sweep* ]]; then
  step sweep 400 python benchmarks/moe_decode_sweep.py --out "$OUT" --tokens 1,4 --rounds 2
  grep -E "^T=|SUMMARY|plain read|weights" "$OUT/sweep.log" | head -60
fi
