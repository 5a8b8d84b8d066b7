#!/usr/bin/env bash
# Decode on one H200 in one call: GPU decode tests, the decode benchmark (fused step; at batch 1 also the
# op-by-op step and the fused step without programmatic dependent launch) and the GEMV tile sweep. Logs and results go to $OUT.
#   OUT=/tmp/out MODE=final bash benchmarks/decode_h200.sh
# MODE=explore: decode kernel + model tests, 2-layer benchmark without prefill, GEMV sweep; MODE=final: all decode
# GPU tests, 2-layer benchmark with prefill, and the PORTER_GEMV_BF16=all/none variants at batch 1.
set -u
OUT=${OUT:-/tmp/decode-out}
MODE=${MODE:-final}
source "$(dirname "$0")/gpu_steps.sh"
KERNEL_TESTS="gemv or router or qkv or index_kernels or attention"
if [ "$MODE" = explore ]; then
  step kernel_tests 35 python -m pytest -q -m gpu tests/test_runtime_gpu_decode.py -k "$KERNEL_TESTS"
  step decode_bench 75 python benchmarks/decode.py --workdir /tmp/m3-decode --out "$OUT" --layers 2 --experts 8 \
    --prefill-tokens 0
  step model_tests 35 python -m pytest -q -m gpu tests/test_runtime_gpu_decode.py -k "not ($KERNEL_TESTS)"
  step gemv_sweep 45 python benchmarks/gemv_sweep.py --rows 1,8 --out "$OUT/gemv_sweep.json"
else
  step decode_tests 90 python -m pytest -q -m gpu tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py
  step decode_bench 65 python benchmarks/decode.py --workdir /tmp/m3-decode --out "$OUT" --layers 2 --experts 8
  for policy in all none; do  # 16-bit-weight linears through runtime.gemv: all / none (default: with adds only)
    step "decode_bench_bf16_$policy" 20 env PORTER_GEMV_BF16=$policy python benchmarks/decode.py \
      --workdir /tmp/m3-decode --out "$OUT/bf16_$policy" --layers 2 --experts 8 --scopes experts \
      --cases 1x1024,1x8192 --prefill-tokens 0
  done
fi
