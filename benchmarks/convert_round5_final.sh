#!/bin/bash
# One H200-machine call after the writeback / slab changes: the GPU conversion tests (bit-identity to the CPU),
# convert_throughput.py on 16 cores at 8 GB warm (bytes floor incl. the GPU device-side floor, copies, porter's
# defaults, and in the same run: CPU with the previous inline writeback; cuda as before (inline writeback, fresh
# slabs registered as made, CUDA context on the first worker's call) and with only the writeback changed), a
# sampled profile of --device cuda, then the writeback A/B on 2 cores (taskset -c 0,1, 2 GB, CPU).
# Logs and JSON go to $OUT.
source "$(dirname "$0")/convert_env.sh" env.txt
timeout ${TGPU:-60} python3 -m pytest -q -m gpu tests/test_convert.py -p no:cacheprovider 2>&1 | tail -5 \
  | tee "$OUT/gpu_tests.log"
taskset -c 0-15 timeout ${T16:-240} python3 benchmarks/convert_throughput.py --sizes 8 --devices cuda,cpu --no-single \
  --floor --variants "inline@cpu:PORTER_WRITEBACK=inline;before@cuda:PORTER_WRITEBACK=inline,PORTER_SLAB_PREFAULT=0;eager-slabs@cuda:PORTER_SLAB_PREFAULT=0" \
  --out "$OUT/throughput.json" 2>&1 | tee "$OUT/throughput.log" | grep -v '^{'
taskset -c 0-15 timeout ${TPROF:-25} python3 benchmarks/convert_profile.py --gb 4 --device cuda --sample \
  --out "$OUT/profile_cuda.json" 2>&1 | tee "$OUT/profile_cuda.log"
taskset -c 0,1 timeout ${T2:-40} python3 benchmarks/convert_throughput.py --sizes 2 --devices cpu --no-single \
  --variants "inline:PORTER_WRITEBACK=inline" --out "$OUT/throughput_2c.json" 2>&1 | tee "$OUT/throughput_2c.log" \
  | grep -v '^{'
