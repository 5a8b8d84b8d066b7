#!/usr/bin/env bash
# H200 call (round 8, conversion): the writeback thread issuing one sync_file_range per shard over everything
# queued (the new default) against one call per range (PORTER_WRITEBACK_COALESCE=0), 8 and 24 GB on 16 cores;
# the 24 GB steady-state profile; the conversion GPU tests. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/convert_round8_call5.sh
# Ran in round 8 (benchmarks/results/convert_round8.md); the coalescing and PORTER_WRITEBACK_COALESCE were removed after it, so at
# later commits both rows run one call per range.
set -u
OUT=${OUT:-/tmp/r8-wb}
source "$(dirname "$0")/gpu_steps.sh"
step convert_tests 60 python -m pytest -q -m gpu tests/test_convert.py
step convert_16c 250 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors,copy-files --sizes 8,24 \
  --variants "each@cuda:PORTER_WRITEBACK_COALESCE=0" --out "$OUT/convert_16c.json"
step build 40 "${BUILD_CHECKPOINT[@]}" /tmp/ck24 20
step steady 50 taskset -c 0-15 "${CONVERT_PROFILE[@]}" --src /tmp/ck24 --out "$OUT/steady.json"
grep -h "warm convert\|warm copy" "$OUT"/convert_16c.log | cut -c1-150
head -6 "$OUT/steady.log"
