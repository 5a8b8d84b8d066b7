#!/bin/bash
# One H200 call for the Triton MoE backend: all GPU tests of tests/test_triton_moe.py once and the race tests REPEAT times in a row (each a fresh pytest
# process), the MoE-layer benchmark (benchmarks/moe_layer.py) and the tile/path A/B
# (benchmarks/moe_ab_h200.py: per-kernel times, ratios to the bytes floor measured in the same run;
# AB_FIRST=1 runs it before the benchmark, whose FP8 tile then comes from it). With two GPUs the
# tests run on the second one while the first runs the benchmarks.
# Logs and results go to $OUT (the device tool's return folder) and to benchmarks/results/.
#   bash benchmarks/run_h200.sh
#   SKIP_TESTS=1 SKIP_AB=1 SKIP_BENCH=1 REPEAT=20 AB_TOKENS=1,4096 BENCH_ARGS="--tokens 1,4096" bash benchmarks/run_h200.sh
# The MoE-layer run takes its FP8 tile from the A/B's fastest fp8x2 row (--fp8-tile-from).
set -o pipefail
cd "$(dirname "$0")/.."
RES=benchmarks/results
OUT=${OUT:-$RES}
mkdir -p "$RES" "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
REPEAT=${REPEAT:-20}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
NGPU=$(nvidia-smi -L | wc -l)
TEST_GPU=$(( NGPU > 1 ? 1 : 0 ))
RACE_TESTS="last_arriver or repeat_calls"

gpu_tests() {
  CUDA_VISIBLE_DEVICES=$TEST_GPU timeout ${TEST_TIMEOUT:-330} python3 -m pytest tests/test_triton_moe.py -m gpu \
    -q -rf -p no:cacheprovider
  local rc=$? done=0
  for i in $(seq "$REPEAT"); do
    log=$(CUDA_VISIBLE_DEVICES=$TEST_GPU timeout 120 python3 -m pytest tests/test_triton_moe.py -m gpu -q \
      -p no:cacheprovider -k "$RACE_TESTS" 2>&1)
    local r=$?
    echo "run $i: $(echo "$log" | tail -1)"
    [ $r -eq 0 ] || { echo "$log"; break; }
    done=$i
  done
  echo "race tests: $done of $REPEAT runs in a row passed"
  [ "$rc" -eq 0 ] && [ "$done" -eq "$REPEAT" ]
}

trc=skipped
if [ -z "$SKIP_TESTS" ] && [ "$NGPU" -gt 1 ]; then
  gpu_tests > "$OUT/gpu_tests.log" 2>&1 &
  tpid=$!
fi
if [ -z "$SKIP_TESTS" ] && [ "$NGPU" -eq 1 ]; then
  gpu_tests 2>&1 | tee "$OUT/gpu_tests.log"
  trc=${PIPESTATUS[0]}
fi
brc=0
if [ -z "$SKIP_AB" ] && [ -n "$AB_FIRST" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout ${AB_TIMEOUT:-300} python3 benchmarks/moe_ab_h200.py --out "$OUT" \
    --tokens "${AB_TOKENS:-4096}" 2>&1 | tee "$OUT/bench_ab.log"
fi
if [ -z "$SKIP_BENCH" ]; then
  AB_JSON=$(ls "$OUT"/bench_ab_*.json 2>/dev/null | head -1)  # the FP8 tile measured fastest by the A/B
  CUDA_VISIBLE_DEVICES=0 timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/moe_layer.py --out "$OUT" \
    ${AB_JSON:+--fp8-tile-from "$AB_JSON"} $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
  brc=${PIPESTATUS[0]}
fi
if [ -z "$SKIP_AB" ] && [ -z "$AB_FIRST" ]; then
  CUDA_VISIBLE_DEVICES=0 timeout ${AB_TIMEOUT:-300} python3 benchmarks/moe_ab_h200.py --out "$OUT" \
    --tokens "${AB_TOKENS:-4096}" 2>&1 | tee "$OUT/bench_ab.log"
fi
if [ -n "$tpid" ]; then
  wait "$tpid"
  trc=$?
  tail -4 "$OUT/gpu_tests.log"
fi
[ "$OUT" != "$RES" ] && [ -z "$NO_COPY" ] && cp "$OUT"/* "$RES"/ 2>/dev/null
echo "tests rc=$trc bench rc=$brc"
[ "$trc" = skipped ] && trc=0
exit $(( trc || brc ))
