#!/bin/bash
# One H200 call for the Triton MoE's decode path: every GPU test of tests/test_triton_moe.py once, the race
# tests REPEAT times in a row (one process, fresh random problems per run), the MoE-layer benchmark at
# decode sizes with per-kernel profiles (benchmarks/moe_layer.py --tag), and optionally the decode timing
# A/B first (benchmarks/moe_decode_sweep.py --phase2). Logs and results go to $OUT.
#   OUT=/tmp/x REPEAT=20 TOKENS=1,4,16,64 TAG=_round5 bash benchmarks/moe_decode_h200.sh
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
REPEAT=${REPEAT:-20}
RACE_TESTS="last_arriver or repeat_calls"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ -n "$TIMING" ]; then
  timeout ${TIMING_TIMEOUT:-200} python3 benchmarks/moe_decode_sweep.py --phase2 --out "$OUT" --tokens "$TIMING" \
    2>&1 | grep -v -i warn | tee "$OUT/timing.log"
fi
trc=0
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_triton_moe.py -m gpu -q -rf -p no:cacheprovider --durations=5 \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  trc=${PIPESTATUS[0]}
  timeout ${RACE_TIMEOUT:-200} python3 benchmarks/repeat_tests.py "$REPEAT" "$RACE_TESTS" 2>&1 \
    | grep -E "^run |race tests|passed|failed|Error|assert" | tee "$OUT/race_tests.log" | tail -4
  rrc=${PIPESTATUS[0]}
  trc=$(( trc || rrc ))
fi
brc=0
if [ -z "$SKIP_BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/moe_layer.py --out "$OUT" --tag "${TAG:-_decode}" \
    --tokens "${TOKENS:-1,4,16,64}" --torch-reps 1 --profile "${PROFILE:-1,16,64}" 2>&1 | grep -v -i warn | tee "$OUT/bench.log"
  brc=${PIPESTATUS[0]}
fi
echo "tests rc=$trc bench rc=$brc"
exit $(( trc || brc ))
