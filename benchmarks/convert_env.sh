#!/bin/bash
# Sourced by the conversion scripts for the H200 machine (convert_h200.sh, convert_round5_*.sh): run from the
# repository root, results to $OUT (default benchmarks/results/), and the machine facts that bound conversion
# speed written to $OUT/$1 (GPU, cores, memory, filesystem, kernel, transparent huge pages, dirty-page limits,
# disk queue depth, torch).
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2; df -hT . | tail -1
  uname -r; cat /sys/kernel/mm/transparent_hugepage/enabled
  cat /proc/sys/vm/dirty_ratio /proc/sys/vm/dirty_background_ratio /proc/sys/vm/dirty_bytes
  cat /sys/block/*/queue/nr_requests 2>/dev/null | head -3; python3 -c "import torch; print('torch', torch.__version__)"
} > "$OUT/${1:-env.txt}" 2>&1
cat "$OUT/${1:-env.txt}"
