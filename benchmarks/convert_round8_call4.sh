#!/usr/bin/env bash
# H200 call (round 8, conversion): is the 24 GB conversion now held by the disk? The durable copy
# (copy-safetensors+fsync) and convert_floor's write/copy + fsync floors at 16 threads next to the conversion
# with the default writeback thread and with PORTER_WRITEBACK=off (no hints; the final fsync writes all). Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/convert_round8_call4.sh
set -u
OUT=${OUT:-/tmp/r8-disk}
source "$(dirname "$0")/gpu_steps.sh"
step convert_24 400 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors,copy-safetensors+fsync,copy-files --sizes 24 --floor \
  --variants "off@cuda:PORTER_WRITEBACK=off" --out "$OUT/convert_24.json"
grep -v "^{" "$OUT/convert_24.log" | cut -c1-220 | tail -40
