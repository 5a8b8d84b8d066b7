#!/usr/bin/env bash
# H200 call (round 8, conversion): the shard journal without fsync (the new default) against the old fsync per
# shard record (PORTER_JOURNAL_FSYNC=1), the fused quantizer and early slab registration, at 8 and 24 GB on 16
# cores and 8 GB on 2; then the steady-state profile at 24 GB and the conversion GPU tests. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/convert_round8_call3.sh
# Ran in round 8 (benchmarks/results/convert_round8.md); PORTER_JOURNAL_FSYNC and PORTER_SLAB_REGISTER were removed after it (the
# journal is fsynced again, as before the call), so at later commits those variants run the default.
set -u
OUT=${OUT:-/tmp/r8-conv}
source "$(dirname "$0")/gpu_steps.sh"
step convert_tests 60 python -m pytest -q -m gpu tests/test_convert.py
step convert_16c 280 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors,copy-files --sizes 8,24 \
  --variants "fsync@cuda:PORTER_JOURNAL_FSYNC=1;fused@cuda:PORTER_CUDA_QUANTIZE=fused;early@cuda:PORTER_SLAB_REGISTER=early" \
  --out "$OUT/convert_16c.json"
step convert_2c 110 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors,copy-files --sizes 8 \
  --variants "fsync@cuda:PORTER_JOURNAL_FSYNC=1" --out "$OUT/convert_2c.json"
step build 40 "${BUILD_CHECKPOINT[@]}" /tmp/ck24 20
step steady_torch 50 taskset -c 0-15 "${CONVERT_PROFILE[@]}" --src /tmp/ck24 --out "$OUT/steady_torch.json"
grep -h "warm convert\|warm copy" "$OUT"/convert_*.log | cut -c1-150
head -12 "$OUT/steady_torch.log"
