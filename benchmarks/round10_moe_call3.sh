#!/usr/bin/env bash
# H200 call (round 10, 3): the experts rebased at load (REBASE_AT_LOAD, the new default): the MoE GPU tests,
# then the MoE layer benchmark (twin, grouped_mm, FP8 floor columns). Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round10_moe_call3.sh
set -u
OUT=${OUT:-/tmp/r10-moe3}
source "$(dirname "$0")/gpu_steps.sh"
step tests 220 python -m pytest -q -m gpu tests/test_triton_moe.py
grep -E "passed|failed|^FAILED|^E  " "$OUT/tests.log" | head -12
step layer 330 python benchmarks/moe_layer.py --out "$OUT" --tag _round10
grep -E "^T=|GPU|bandwidth" "$OUT/layer.log" | head -30
