#!/bin/bash
# One H200-machine call: what holds `porter convert --device cuda` (and the CPU path) below the bytes floor.
# 1. convert_throughput.py on 16 cores, ~4 GB real-dims checkpoint, warm: the bytes floor (convert_floor.py:
#    multi-threaded read, write, copy, each + fsync), the copies, and conversions under porter.pipeline's
#    writeback modes (PORTER_WRITEBACK) for cuda and cpu;
# 2. convert_profile.py --sample (core-seconds, thread-seconds of wall per stage, stack samples) for cuda.
# When it ran (round 5) it also A/B'd writes through memory mappings of the shards; they measured no faster
# and were not kept (benchmarks/results/convert_round5_ab_h200_16c.log, convert_throughput_round5.md).
# Logs and JSON go to $OUT (default benchmarks/results/).
source "$(dirname "$0")/convert_env.sh" env.txt
taskset -c 0-15 timeout ${TAB:-150} python3 benchmarks/convert_throughput.py --sizes ${GB:-4} --devices cuda,cpu \
  --no-single --floor --out "$OUT/ab.json" \
  --variants "inline:PORTER_WRITEBACK=inline;off:PORTER_WRITEBACK=off" \
  2>&1 | tee "$OUT/ab.log" | grep -v '^{'
taskset -c 0-15 timeout ${TPROF:-30} python3 benchmarks/convert_profile.py --gb 4 --device cuda --sample \
  --out "$OUT/profile_cuda_default.json" 2>&1 | tee "$OUT/profile_cuda_default.log"
