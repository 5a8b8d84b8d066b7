#!/usr/bin/env bash
# H200 call (round 9, conversion): the compiled C quantizer (porter/mxfp8_cpu.c) on the CPU path against the
# torch ops (PORTER_CPU_QUANTIZE=torch) and --device cuda, 16 cores and 2 cores; its tests on this host's CPU
# and the GPU conversion tests (CPU and GPU conversions byte-identical). Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/convert_round9_call1.sh
set -u
OUT=${OUT:-/tmp/r9-c1}
source "$(dirname "$0")/gpu_steps.sh"
{ command -v cc gcc; cc --version | head -1; lscpu | grep -i "model name\|^flags" | cut -c1-400; } >> "$OUT/gpu.txt" 2>&1
step tests_mxfp8 120 python -m pytest -q -p no:cacheprovider tests/test_mxfp8_native.py tests/test_mxfp8.py
step tests_convert_gpu 200 python -m pytest -q -p no:cacheprovider tests/test_convert.py -m gpu
step quantize_cpu 60 python -c 'import os, time, torch
from porter.format import mxfp8
from concurrent.futures import ThreadPoolExecutor
torch.set_num_threads(1)
w = torch.randn(6144, 6144).bfloat16()
for path in ("torch", "native"):
    os.environ["PORTER_CPU_QUANTIZE"] = path
    for workers in (1, 16):
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda _: mxfp8.quantize_with_error(w[:1024]), range(workers)))
            t = time.perf_counter(); list(pool.map(lambda _: mxfp8.quantize_with_error(w), range(workers))); dt = time.perf_counter() - t
        print(f"{path:6s} {workers:2d} threads: {workers * w.numel() * 2 / 1e9 / dt:6.2f} GB/s of bf16 [6144, 6144] weights")'
step convert_16c_8 200 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda \
  --copies copy-safetensors,copy-files --sizes 8 --variants "torchq@cpu:PORTER_CPU_QUANTIZE=torch" \
  --out "$OUT/convert_16c_8.json"
step convert_2c 150 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda \
  --copies copy-safetensors,copy-files --sizes 2 --variants "torchq@cpu:PORTER_CPU_QUANTIZE=torch" \
  --out "$OUT/convert_2c.json"
step convert_16c_24 200 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda \
  --copies copy-safetensors,copy-files --sizes 24 --out "$OUT/convert_16c_24.json"
grep -h "warm convert\|warm copy\|GB checkpoint" "$OUT"/convert_*.log | cut -c1-150
grep -h "threads:" "$OUT"/quantize_cpu.log
