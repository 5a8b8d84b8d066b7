#!/usr/bin/env bash
# Round 7's fifth H200 call: shard records journaled by a thread of their own (default) vs by the worker that
# finished the shard (PORTER_JOURNAL=worker), each with the fused GPU quantizer (PORTER_CUDA_QUANTIZE=fused)
# and with torch ops (the default): --device cuda on 16 cores (8 GB) and on 2 cores (8 GB).
#   OUT=/tmp/out bash benchmarks/round7_call5.sh
set -u
OUT=${OUT:-/tmp/r7-out}
source "$(dirname "$0")/gpu_steps.sh"
step convert_tests 40 python -m pytest -q -m gpu -p no:cacheprovider tests/test_convert.py
v="fused@cuda:PORTER_CUDA_QUANTIZE=fused;jworker@cuda:PORTER_JOURNAL=worker"
v="$v;fused+jworker@cuda:PORTER_CUDA_QUANTIZE=fused,PORTER_JOURNAL=worker"
cmp=(--copies copy-safetensors,copy-files --sizes 8)
step convert_16c 200 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" "${cmp[@]}" --repeats 2 --variants "$v" --out "$OUT/convert_16c.json"
step convert_2c 150 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" "${cmp[@]}" --variants "$v" --out "$OUT/convert_2c.json"
grep -h "warm \|copy" "$OUT"/convert_*.log | grep -v "^{" | head -40
