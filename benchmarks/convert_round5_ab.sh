#!/bin/bash
# One H200-machine call: what holds `porter convert --device cuda` (and the CPU path) below the bytes floor.
# 1. convert_throughput.py on 16 cores, ~4 GB real-dims checkpoint, warm: the bytes floor (convert_floor.py:
#    multi-threaded read, write, copy, each + fsync), the copies, and conversions under porter.pipeline's
#    write / writeback modes (PORTER_WRITE, PORTER_WRITEBACK) for cuda and cpu;
# 2. convert_profile.py --sample (core-seconds, thread-seconds of wall per stage, stack samples) for cuda in
#    the default modes and the mapped + thread modes.
# Logs and JSON go to $OUT (default benchmarks/results/).
source "$(dirname "$0")/convert_env.sh" env.txt
taskset -c 0-15 timeout ${TAB:-150} python3 benchmarks/convert_throughput.py --sizes ${GB:-4} --devices cuda,cpu \
  --no-single --floor --out "$OUT/ab.json" \
  --variants "thread:PORTER_WRITEBACK=thread;off:PORTER_WRITEBACK=off;mapped+thread:PORTER_WRITE=mapped,PORTER_WRITEBACK=thread;mapped+populate+thread:PORTER_WRITE=mapped,PORTER_MAPPED_POPULATE=1,PORTER_WRITEBACK=thread" \
  2>&1 | tee "$OUT/ab.log" | grep -v '^{'
for v in "default:" "mapped-thread:PORTER_WRITE=mapped PORTER_WRITEBACK=thread"; do
  name=${v%%:*}; vars=${v#*:}
  env $vars taskset -c 0-15 timeout ${TPROF:-30} python3 benchmarks/convert_profile.py --gb 4 --device cuda --sample \
    --out "$OUT/profile_cuda_$name.json" 2>&1 | tee "$OUT/profile_cuda_$name.log"
done
