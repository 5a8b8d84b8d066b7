#!/usr/bin/env bash
# Round 7's third H200 call: the fused GPU quantizer resolved in the background without making parts wait
# (parts that start earlier use the torch ops): conversion tests, what the background resolution costs in a
# fresh process, then --device cuda fused vs torch ops on 16 cores (8 GB) and on 2 cores (2 and 8 GB), two
# repeats each, and the fused run's profile.
#   OUT=/tmp/out bash benchmarks/round7_call3.sh
set -u
OUT=${OUT:-/tmp/r7-out}
source "$(dirname "$0")/gpu_steps.sh"
step convert_tests 40 python -m pytest -q -m gpu -p no:cacheprovider tests/test_convert.py tests/test_mxfp8_triton.py
step warm_up_cost 30 python -c '
import time; t0 = time.perf_counter(); import torch; torch.empty(1, device="cuda"); t1 = time.perf_counter()
import triton, triton.language; t2 = time.perf_counter()
from porter import mxfp8_triton; t3 = time.perf_counter()
mxfp8_triton.warm_up(torch.device("cuda"), "rceil"); t4 = time.perf_counter()
print(f"torch + CUDA context {t1 - t0:.3f} s, import triton {t2 - t1:.3f} s, porter.mxfp8_triton {t3 - t2:.3f} s, "
      f"warm_up (kernel load + first launches) {t4 - t3:.3f} s")'
cmp="python benchmarks/convert_throughput.py --devices cuda,cpu --no-single --max-shard-size 512MB --repeats 2 \
  --copies copy-safetensors,copy-files --variants torchq@cuda:PORTER_CUDA_QUANTIZE=torch"
step convert_16c 170 taskset -c 0-15 $cmp --sizes 8 --out "$OUT/convert_16c.json"
step convert_2c 200 taskset -c 0,1 $cmp --sizes 2,8 --out "$OUT/convert_2c.json"
step profile_fused 40 taskset -c 0-15 python benchmarks/convert_profile.py --gb 4 --device cuda --sample \
  --max-shard-size 512MB --out "$OUT/profile_fused.json"
grep -h "warm \|copy" "$OUT"/convert_*.log | grep -v "^{" | head -40
grep -v "^{" "$OUT/profile_fused.log" | head -40
