#!/bin/bash
# One GPU call: end-to-end tests on CUDA (backend auto-selection, runtime CUDA vs CPU, porter verify with the
# Triton backend), then README command 1 with `--backend triton --device cuda`. Logs go to $OUT and
# benchmarks/results/. Needs only what the H200 image has (torch, triton, safetensors, tokenizers, click, ...).
set -o pipefail
cd "$(dirname "$0")/.."
RES=benchmarks/results
OUT=${OUT:-$RES}
mkdir -p "$RES" "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pytest tests/test_gpu_end_to_end.py -m gpu -q -rf -p no:cacheprovider 2>&1 | tee "$OUT/gpu_e2e_tests.log"
rc=$?
T=$(mktemp -d)
{ python3 examples/tiny_checkpoint.py "$T/tiny-m3" \
  && python3 -m porter.cli -q convert "$T/tiny-m3" --output "$T/tiny-m3-mxfp8" \
  && python3 -m porter.cli verify "$T/tiny-m3-mxfp8" --backend triton --device cuda \
       --report "$OUT/verify_triton_cuda.json" --plot "$OUT/verify_triton_cuda.svg"; } 2>&1 | tee "$OUT/verify_triton_cuda.log"
vrc=$?
[ "$OUT" != "$RES" ] && cp "$OUT"/gpu_e2e_tests.log "$OUT"/verify_triton_cuda.* "$RES"/ 2>/dev/null
echo "e2e tests rc=$rc verify rc=$vrc"
exit $(( rc || vrc ))
