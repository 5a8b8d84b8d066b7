#!/bin/bash
# One H200 call for issue #5: the GPU tests of the Triton MoE backend, then the MoE-layer benchmark
# (tile-config A/B: python3 benchmarks/moe_ab_h200.py --out DIR, results in bench_ab_*).
# Logs and results go to $OUT (the device tool's return folder) and to benchmarks/results/.
#   bash benchmarks/run_h200.sh            # tests + benchmark
#   BENCH_ARGS=--sweep bash benchmarks/run_h200.sh   # also time alternative tile configs
#   SKIP_TESTS=1 bash benchmarks/run_h200.sh
set -o pipefail
cd "$(dirname "$0")/.."
RES=benchmarks/results
OUT=${OUT:-$RES}
mkdir -p "$RES" "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest tests/test_triton_moe.py -m gpu -q -rf -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_tests.log"
  rc=$?
fi
timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/moe_layer.py --out "$OUT" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
brc=$?
[ "$OUT" != "$RES" ] && cp "$OUT"/* "$RES"/ 2>/dev/null
echo "tests rc=$rc bench rc=$brc"
exit $(( rc || brc ))
