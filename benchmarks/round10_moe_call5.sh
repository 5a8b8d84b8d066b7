#!/usr/bin/env bash
# H200 call (round 10, 5): the runtime / end-to-end / convert + verify GPU tests on the rebased default, and
# the decode step at real layer dims (benchmarks/decode.py) with the experts rebased at load and as stored
# (PORTER_MOE_REBASE=0). Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round10_moe_call5.sh
set -u
OUT=${OUT:-/tmp/r10-moe5}
source "$(dirname "$0")/gpu_steps.sh"
step decode_tests 150 python -m pytest -q -m gpu tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py
grep -E "passed|failed|^FAILED" "$OUT/decode_tests.log" | tail -4
step convert_verify_tests 90 python -m pytest -q -m gpu tests/test_convert.py tests/test_verify_gpu.py
grep -E "passed|failed|^FAILED" "$OUT/convert_verify_tests.log" | tail -4
bench="python benchmarks/decode.py --workdir /tmp/m3-decode --layers 2 --experts 8 --scopes experts --prefill-tokens 0"
step decode_rebased 60 $bench --out "$OUT/d" --cases 1x1024,1x8192,8x1024,32x1024
grep -iE "^batch|moe|dense|floor" "$OUT/decode_rebased.log" | head -14
PORTER_MOE_REBASE=0 step decode_stored 60 $bench --out "$OUT/d_stored" --cases 1x1024,1x8192,8x1024,32x1024
grep -iE "^batch|moe|dense|floor" "$OUT/decode_stored.log" | head -14
