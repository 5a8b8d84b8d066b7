#!/usr/bin/env bash
# Round 7's first H200 call, most important first: the fused GPU quantizer (porter/mxfp8_triton.py) against the
# CPU bytes, conversion and verify GPU tests; the GPU path's device-side floor with torch ops vs the fused
# kernel; --device cuda / cpu throughput on 16 and on 2 cores with the torch-ops quantizer as the A/B variant;
# then the GPU tests and decode benchmark of what round 6 changed host-side after its last GPU run.
#   OUT=/tmp/out bash benchmarks/round7_call1.sh
set -u
OUT=${OUT:-/tmp/r7-out}
source "$(dirname "$0")/gpu_steps.sh"
step fused_tests 90 python -m pytest -q -m gpu -p no:cacheprovider tests/test_mxfp8_triton.py
step convert_verify_tests 60 python -m pytest -q -m gpu -p no:cacheprovider tests/test_convert.py tests/test_verify_gpu.py
step gpu_floor 100 python -c 'import sys; sys.path[:0] = ["benchmarks", "."]; import convert_floor as f; f.gpu_floor(16)'
cmp="python benchmarks/convert_throughput.py --devices cuda,cpu --no-single --max-shard-size 512MB \
  --copies copy-safetensors,copy-files --variants torchq@cuda:PORTER_CUDA_QUANTIZE=torch"
step convert_16c 150 taskset -c 0-15 $cmp --sizes 8 --out "$OUT/convert_16c.json"
step convert_2c 90 taskset -c 0,1 $cmp --sizes 2 --out "$OUT/convert_2c.json"
step decode_tests 110 python -m pytest -q -m gpu -p no:cacheprovider tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py
step moe_fp8_tests 50 python -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_moe.py -k "fp8 or rebase"
step decode_bench 40 python benchmarks/decode.py --workdir /tmp/m3-decode --layers 2 --experts 8 --scopes experts \
  --prefill-tokens 0 --out "$OUT/d"
grep -h "GB/s\|x copy\|ratio" "$OUT"/convert_*.log | head -40
