#!/bin/bash
# One call on the H200 machine (16 cores + one H200) for conversion throughput: the GPU conversion tests,
# convert_throughput.py on 16 cores (8 GB, CPU and --device cuda, warm and cold page cache) and on 2 cores
# (taskset -c 0,1, 2 GB, CPU), then per-stage profiles (convert_profile.py) of --device cuda and of the CPU.
# Each step has its own time limit (T*, seconds). Logs and JSON go to $OUT (default benchmarks/results/).
#   bash benchmarks/convert_h200.sh
source "$(dirname "$0")/convert_env.sh" convert_env.txt
timeout ${TGPU:-40} python3 -m pytest -q -m gpu tests/test_convert.py -p no:cacheprovider 2>&1 | tail -5 \
  | tee "$OUT/convert_gpu_tests.log"
taskset -c 0-15 timeout ${T16:-140} python3 benchmarks/convert_throughput.py --sizes 8 --devices cpu,cuda --no-single \
  --cache warm,cold --out "$OUT/convert_throughput_h200_16c.json" 2>&1 | tee "$OUT/convert_16c.log" | grep -v '^{'
taskset -c 0,1 timeout ${T2:-45} python3 benchmarks/convert_throughput.py --sizes 2 --devices cpu --no-single \
  --out "$OUT/convert_throughput_h200_2c.json" 2>&1 | tee "$OUT/convert_2c.log" | grep -v '^{'
for dev in cuda cpu; do
  taskset -c 0-15 timeout ${TPROF:-25} python3 benchmarks/convert_profile.py --gb 4 --device $dev \
    --out "$OUT/convert_profile_h200_$dev.json" 2>&1 | tee "$OUT/convert_profile_$dev.log"
done
