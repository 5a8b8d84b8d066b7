#!/usr/bin/env bash
# H200 call (round 9, conversion): where the CPU path's time goes with the compiled quantizer, on 2 and on 16
# cores of the H200 machine (convert_profile.py --device cpu), and the GPU tests that compare against the CPU
# quantizer. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/convert_round9_call2.sh
set -u
OUT=${OUT:-/tmp/r9-c2}
source "$(dirname "$0")/gpu_steps.sh"
step tests_gpu 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_mxfp8_triton.py tests/test_verify_gpu.py
step build_2 60 "${BUILD_CHECKPOINT[@]}" /tmp/r9src2 2
step build_8 120 "${BUILD_CHECKPOINT[@]}" /tmp/r9src8 7
step profile_2c 60 taskset -c 0,1 python benchmarks/convert_profile.py --device cpu --max-shard-size 512MB \
  --src /tmp/r9src2 --out "$OUT/profile_2c.json"
step profile_2c_torch 60 env PORTER_CPU_QUANTIZE=torch taskset -c 0,1 python benchmarks/convert_profile.py \
  --device cpu --max-shard-size 512MB --src /tmp/r9src2 --out "$OUT/profile_2c_torch.json"
step profile_16c 60 taskset -c 0-15 python benchmarks/convert_profile.py --device cpu --max-shard-size 512MB \
  --src /tmp/r9src8 --out "$OUT/profile_16c.json"
tail -n 2 "$OUT"/tests_gpu.log
for f in profile_2c profile_2c_torch profile_16c; do echo "== $f"; grep -v "longest\|journal writes" "$OUT/$f.log" | tail -16; done
