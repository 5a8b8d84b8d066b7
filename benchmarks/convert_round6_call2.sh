#!/bin/bash
# Second H200-machine call: the journal write (its fsync) moved out of the pipeline's lock. (1) GPU conversion
# tests (bit-identity to the CPU); (2) 16 cores, 8 GB warm, 512MB shards (~13 shards, the release's regime):
# copies, --device cuda now / with the journal under the lock as before (PORTER_JOURNAL_UNDER_LOCK=1) / 16
# shards in flight / 32 workers / 5GB shards (round 5's 2-shard layout), and the CPU path (the bytes every
# run is compared with); (3) 2 cores (taskset -c 0,1), 2 GB: copies, cuda, CPU; (4) a sampled profile of cuda.
# Logs and JSON go to $OUT.
# PORTER_JOURNAL_UNDER_LOCK was removed after this call: at later commits locked@cuda runs porter's defaults.
# Results: benchmarks/results/convert_round6.md.
source "$(dirname "$0")/convert_env.sh" env.txt
timeout ${TGPU:-30} python3 -m pytest -q -m gpu tests/test_convert.py -p no:cacheprovider 2>&1 | tail -5 \
  | tee "$OUT/gpu_tests.log"
taskset -c 0-15 timeout ${T16:-100} python3 benchmarks/convert_throughput.py --sizes 8 --devices cuda,cpu \
  --no-single --max-shard-size 512MB --copies copy-safetensors,copy-files --variants \
  "locked@cuda:PORTER_JOURNAL_UNDER_LOCK=1;in16@cuda:PORTER_SHARDS_IN_FLIGHT=16;w32@cuda:WORKERS=32;5gb@cuda:SHARD=5GB" \
  --out "$OUT/throughput_16c.json" 2>&1 | tee "$OUT/throughput_16c.log" | grep -v '^{'
taskset -c 0,1 timeout ${T2:-40} python3 benchmarks/convert_throughput.py --sizes 2 --devices cuda,cpu --no-single \
  --max-shard-size 512MB --copies copy-safetensors,copy-files \
  --out "$OUT/throughput_2c.json" 2>&1 | tee "$OUT/throughput_2c.log" | grep -v '^{'
taskset -c 0-15 timeout ${TPROF:-25} python3 benchmarks/convert_profile.py --gb 4 --device cuda --sample \
  --max-shard-size 512MB --out "$OUT/profile_cuda.json" 2>&1 | tee "$OUT/profile_cuda.log"
