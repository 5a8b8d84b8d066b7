#!/usr/bin/env bash
# Round 7's second H200 call: the fused GPU quantizer with its kernel loaded in the background (CUDA init
# thread) instead of by the first part: tests, then --device cuda fused vs torch ops (PORTER_CUDA_QUANTIZE=torch)
# on 16 and 2 cores, two repeats each, and where a conversion's time goes with each (convert_profile).
#   OUT=/tmp/out bash benchmarks/round7_call2.sh
set -u
OUT=${OUT:-/tmp/r7-out}
source "$(dirname "$0")/gpu_steps.sh"
step fused_tests 60 python -m pytest -q -m gpu -p no:cacheprovider tests/test_mxfp8_triton.py
step convert_tests 40 python -m pytest -q -m gpu -p no:cacheprovider tests/test_convert.py
cmp="python benchmarks/convert_throughput.py --devices cuda,cpu --no-single --max-shard-size 512MB --repeats 2 \
  --copies copy-safetensors,copy-files --variants torchq@cuda:PORTER_CUDA_QUANTIZE=torch"
step convert_16c 150 taskset -c 0-15 $cmp --sizes 8 --out "$OUT/convert_16c.json"
step convert_2c 90 taskset -c 0,1 $cmp --sizes 2 --out "$OUT/convert_2c.json"
prof="taskset -c 0-15 python benchmarks/convert_profile.py --gb 4 --device cuda --sample --max-shard-size 512MB"
step profile_fused 40 $prof --out "$OUT/profile_fused.json"
step profile_torch 40 env PORTER_CUDA_QUANTIZE=torch $prof --out "$OUT/profile_torch.json"
grep -h "warm \|copy" "$OUT"/convert_*.log | grep -v "^{" | head -30
for f in profile_fused profile_torch; do echo "== $f"; grep -v "^{" "$OUT/$f.log" | head -45; done
