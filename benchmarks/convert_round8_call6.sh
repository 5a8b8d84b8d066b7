#!/usr/bin/env bash
# H200 call (round 8, conversion): the journal written by a thread of its own (PORTER_JOURNAL_THREAD=1, still
# fsynced) and/or writeback started by each worker after its write (PORTER_WRITEBACK=inline), 24 GB on 16 cores,
# and the pair against the default on 2 cores at 8 GB. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/convert_round8_call6.sh
# Ran in round 8 (benchmarks/results/convert_round8.md); PORTER_JOURNAL_THREAD was removed after it (no gain beyond
# the run-to-run spread), so at later commits the jthread variants run the default journal.
set -u
OUT=${OUT:-/tmp/r8-j}
source "$(dirname "$0")/gpu_steps.sh"
step convert_16c 150 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors,copy-files --sizes 24 \
  --variants "inline@cuda:PORTER_WRITEBACK=inline;jthread@cuda:PORTER_JOURNAL_THREAD=1;jthread_inline@cuda:PORTER_JOURNAL_THREAD=1,PORTER_WRITEBACK=inline" \
  --out "$OUT/convert_16c.json"
step convert_2c 75 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" \
  --copies copy-safetensors --sizes 8 \
  --variants "jthread_inline@cuda:PORTER_JOURNAL_THREAD=1,PORTER_WRITEBACK=inline" --out "$OUT/convert_2c.json"
grep -h "warm convert\|warm copy" "$OUT"/convert_*.log | cut -c1-140
