#!/usr/bin/env bash
# H200 call (round 10, 4): the mended test, the runtime / verify / end-to-end GPU tests on the rebased default,
# the MoE layer with the weights kept as stored (PORTER_MOE_REBASE=0: the same run's baseline for decode) and
# `porter verify` at real layer dims (verify_fp8_prefill) with and without the load-time rebase. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round10_moe_call4.sh
set -u
OUT=${OUT:-/tmp/r10-moe4}
source "$(dirname "$0")/gpu_steps.sh"
step tests 240 python -m pytest -q -m gpu tests/test_triton_moe.py -k "wide_scale or rebase" \
  tests/test_runtime_gpu_decode.py tests/test_verify_gpu.py tests/test_gpu_end_to_end.py
grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | head -12
step layer_rebased 120 python benchmarks/moe_layer.py --out "$OUT" --tag _round10_rebased --tokens 1,4,16,64
grep -E "^T=" "$OUT/layer_rebased.log" | cut -c1-200
PORTER_MOE_REBASE=0 step layer_stored 120 python benchmarks/moe_layer.py --out "$OUT" --tag _round10_stored --tokens 1,4,16,64
grep -E "^T=" "$OUT/layer_stored.log" | cut -c1-200
step verify_rebased 100 python benchmarks/verify_fp8_prefill.py --out "$OUT/verify_rebased.json"
grep -E "^FP8" "$OUT/verify_rebased.log"
PORTER_MOE_REBASE=0 step verify_stored 100 python benchmarks/verify_fp8_prefill.py --out "$OUT/verify_stored.json"
grep -E "^FP8" "$OUT/verify_stored.log"
