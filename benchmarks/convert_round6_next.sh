#!/bin/bash
# Prepared at the end of round 6, NOT RUN yet (no device time left): what serializes --device cuda's workers
# (benchmarks/results/convert_round6.md, "Next steps"). (1) the GPU floor with the host work of a worker
# (gpu_floor's "host" and "all+host": sha256 + pwrite of each part's values) beside the GPU-only rows: if
# all+host takes much longer than the slower of all and host, host and GPU work serialize across threads;
# (2) the cuda profile, whose GPU section is now split into the two device waits (finiteness-check sync,
# final stream.synchronize) and the rest (host: launches, GIL); (3) the same with the GIL handed over 10x
# more often (sys.setswitchinterval 0.0005): a GIL convoy would move the time. Logs and JSON go to $OUT.
source "$(dirname "$0")/convert_env.sh" env.txt
timeout ${TGPU:-60} python3 -c 'import sys; sys.path[:0] = ["benchmarks", "."]; import convert_floor as f; f.gpu_floor(16)' \
  2>&1 | tee "$OUT/gpu_floor.log"
taskset -c 0-15 timeout ${TPROF:-30} python3 benchmarks/convert_profile.py --gb 4 --device cuda --sample \
  --max-shard-size 512MB --out "$OUT/profile_cuda.json" 2>&1 | tee "$OUT/profile_cuda.log"
taskset -c 0-15 timeout ${TPROF:-30} python3 benchmarks/convert_profile.py --gb 4 --device cuda --sample \
  --max-shard-size 512MB --switch-interval 0.0005 --out "$OUT/profile_cuda_si.json" 2>&1 | tee "$OUT/profile_cuda_si.log"
