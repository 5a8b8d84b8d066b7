#!/bin/bash
# One H200-machine call: where --device cuda's time goes once the 8 GB checkpoint is written as many output
# shards (512MB: ~11 shards, the regime of the real release's ~86 shards of 5 GB), and what spreads the writes.
# (1) GPU conversion tests (bit-identity to the CPU); (2) 16 cores, 8 GB, warm: bytes floor of the 512MB layout
# (incl. the copy interleaved over 4 shards as porter writes, one file per thread, and the GPU device-side
# floor), the safetensors and file copies, --device cuda at 512MB with 1/4 (porter's default)/8/16 shards in
# flight, with the blocking CUDA wait, with fallocated shards, at 5GB (round 5's 2-shard layout), and the CPU
# path at 512MB (the bytes every cuda run is compared with); (3) a sampled profile of cuda at 512MB, 16 shards in flight; (4) 2 cores
# (taskset -c 0,1), 2 GB: copies, cuda (spin and block wait), CPU. Logs and JSON go to $OUT.
# PORTER_CUDA_WAIT and PORTER_PREALLOCATE were removed after this call (measured no gain): at later commits the
# block@cuda and falloc@cuda variants run porter's defaults. Results: benchmarks/results/convert_round6.md.
source "$(dirname "$0")/convert_env.sh" env.txt
timeout ${TGPU:-40} python3 -m pytest -q -m gpu tests/test_convert.py -p no:cacheprovider 2>&1 | tail -5 \
  | tee "$OUT/gpu_tests.log"
taskset -c 0-15 timeout ${T16:-170} python3 benchmarks/convert_throughput.py --sizes 8 --devices cuda,cpu \
  --no-single --floor --max-shard-size 512MB --copies copy-safetensors,copy-files --variants \
  "5gb@cuda:SHARD=5GB;in1@cuda:PORTER_SHARDS_IN_FLIGHT=1;in8@cuda:PORTER_SHARDS_IN_FLIGHT=8;in16@cuda:PORTER_SHARDS_IN_FLIGHT=16;block@cuda:PORTER_CUDA_WAIT=block;falloc@cuda:PORTER_PREALLOCATE=fallocate" \
  --out "$OUT/throughput_16c.json" 2>&1 | tee "$OUT/throughput_16c.log" | grep -v '^{'
PORTER_SHARDS_IN_FLIGHT=16 taskset -c 0-15 timeout ${TPROF:-30} python3 benchmarks/convert_profile.py --gb 4 --device cuda --sample \
  --max-shard-size 512MB --out "$OUT/profile_cuda.json" 2>&1 | tee "$OUT/profile_cuda.log"
taskset -c 0,1 timeout ${T2:-70} python3 benchmarks/convert_throughput.py --sizes 2 --devices cuda,cpu --no-single \
  --max-shard-size 512MB --copies copy-safetensors,copy-files --variants "block@cuda:PORTER_CUDA_WAIT=block" \
  --out "$OUT/throughput_2c.json" 2>&1 | tee "$OUT/throughput_2c.log" | grep -v '^{'
