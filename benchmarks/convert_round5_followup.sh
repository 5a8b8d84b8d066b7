#!/bin/bash
# Follow-up H200-machine call (not run yet): what round 5 left open. (1) the GPU path's device-side floor
# (convert_floor.gpu_floor: buffers made before timing); (2) 16-core CPU at 8 GB, writeback thread vs inline;
# (3) --device cuda with 1 GB shards, 1 vs 4 shards in flight: does spreading writes over 4 inodes relieve the
# pwrite wait now that the disk waits are gone. Logs and JSON go to $OUT.
source "$(dirname "$0")/convert_env.sh" env.txt
timeout ${TGPU:-40} python3 -c 'import sys; sys.path[:0] = ["benchmarks", "."]; import convert_floor as f; f.gpu_floor(16)' \
  2>&1 | tee "$OUT/gpu_floor.log"
taskset -c 0-15 timeout ${TCPU:-120} python3 benchmarks/convert_throughput.py --sizes 8 --devices cpu --no-single \
  --variants "inline:PORTER_WRITEBACK=inline" --out "$OUT/throughput_cpu.json" 2>&1 | tee "$OUT/throughput_cpu.log" \
  | grep -v '^{'
taskset -c 0-15 timeout ${TCUDA:-120} python3 benchmarks/convert_throughput.py --sizes 8 --devices cuda --no-single \
  --max-shard-size 1GB --variants "in1:PORTER_SHARDS_IN_FLIGHT=1" --out "$OUT/throughput_cuda_1gb.json" 2>&1 \
  | tee "$OUT/throughput_cuda_1gb.log" | grep -v '^{'
