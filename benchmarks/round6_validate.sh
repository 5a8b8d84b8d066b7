#!/usr/bin/env bash
# One H200 call that re-runs every GPU test file touched by code changed without a GPU, the split-K
# race selection in fresh processes, and the decode benchmark (MoE-scope layers, no prefill). Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round6_validate.sh
set -u
OUT=${OUT:-/tmp/validate-out}
source "$(dirname "$0")/gpu_steps.sh"
step decode_tests 110 python -m pytest -q -m gpu tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py
step convert_verify_tests 45 python -m pytest -q -m gpu tests/test_convert.py tests/test_verify_gpu.py
step moe_tests 200 python -m pytest -q -m gpu tests/test_triton_moe.py
for i in 1 2 3 4 5; do
  step "race_$i" 40 python -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_moe.py -k "last_arriver or repeat_calls"
done
step decode_bench ${TBENCH:-90} python benchmarks/decode.py --workdir /tmp/m3-decode --out "$OUT/decode" --layers 2 \
  --experts 8 --scopes experts --prefill-tokens 0
