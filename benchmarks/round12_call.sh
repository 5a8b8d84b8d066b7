#!/usr/bin/env bash
# H200 calls (round 12). STEPS picks what one call runs (logs to $OUT):
#   tests     every GPU test file (MoE kernels, mxfp8 Triton, runtime decode, end to end, convert, verify)
#   prefetch  (needs commit e35e848: the experiment was taken out again after this measurement) A/B of GEMM2_PREFETCH on the whole routed layer at MiniMax-M3 dims (None: as before; 0: GEMM2
#             launched early only; 1024 / 3072: plus an L2 prefetch of that many bytes of each weight row)
#   layer     the MoE layer table on the rebased default, T = 1..4096 with 512 and 768 added
#   decode    benchmarks/decode.py, experts rebased at load vs as stored (PORTER_MOE_REBASE=0)
#   crossover the MoE layer at T = 256..512 (W8A16 vs FP8 prefill: where FP8 starts to win)
#   moetests  tests/test_triton_moe.py alone (the GEMM2_PREFETCH experiment taken out again)
#   verify    benchmarks/verify_fp8_prefill.py on a 600-token prompt (FP8 prefill from 512 tokens) and the
#             verify GPU tests
#   convert   conversion with streaming chunk digests: 2 cores (taskset -c 0,1; 1.92 GB, CPU + cuda, and the
#             CPU path's stage profile) and 16 cores (8.1 GB, CPU + cuda)
#   convmap   (needs commit d241d27: mapped source reads were taken out again after this measurement) the CPU
#             path mapping source tensors against reading them (PORTER_SOURCE_MAP=0), in the
#             same runs: 2 cores (1.92 GB, two repeats, and both stage profiles) and 16 cores (8.1 GB)
#   OUT=/tmp/out STEPS="tests prefetch" bash benchmarks/round12_call.sh
set -u
OUT=${OUT:-/tmp/r12}
STEPS=${STEPS:-tests}
source "$(dirname "$0")/gpu_steps.sh"
if has tests; then
  step gpu_tests 330 python -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py tests/test_mxfp8_triton.py \
    tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py tests/test_convert.py tests/test_verify_gpu.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.log" | head -16
fi
if has prefetch; then
  step prefetch_ab 220 python benchmarks/moe_knob_ab.py --knob GEMM2_PREFETCH --values None,0,1024,3072 \
    --tokens 1,4,16,64 --rounds 5 --out "$OUT/prefetch_ab.json"
  grep -E "^T=|streaming|None|^ " "$OUT/prefetch_ab.log" | head -40
fi
if has layer; then
  step layer 330 python benchmarks/moe_layer.py --out "$OUT" --tag _round12 --tokens 1,4,16,64,256,512,768,1024,4096
  grep -E "^T=|GPU|bandwidth" "$OUT/layer.log" | head -30
fi
if has crossover; then
  step crossover 200 python benchmarks/moe_layer.py --out "$OUT" --tag _round12_crossover --tokens 256,320,384,448,512
  grep -E "^\| [0-9]+ \| (w8a16|fp8x2)" "$OUT"/moe_layer_round12_crossover*.md | tail -12
fi
if has moetests; then
  step moe_tests 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/moe_tests.log" | head -16
fi
if has verify; then
  step verify_fp8_prefill 200 python benchmarks/verify_fp8_prefill.py --min-tokens 600 --out "$OUT/verify_fp8_prefill_600.json"
  grep -E "FP8 prefill" "$OUT/verify_fp8_prefill.log" | tail -3
  step verify_tests 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_verify_gpu.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/verify_tests.log" | head -8
fi
if has decode; then
  bench="python benchmarks/decode.py --workdir /tmp/m3-decode --layers 2 --experts 8 --scopes experts --prefill-tokens 0"
  step decode_rebased 120 $bench --out "$OUT/d" --cases 1x1024,1x8192,8x1024,32x1024
  grep -iE "^batch|moe|dense|floor" "$OUT/decode_rebased.log" | head -14
  step decode_stored 100 env PORTER_MOE_REBASE=0 $bench --out "$OUT/d_stored" --cases 1x1024,1x8192,8x1024,32x1024
  grep -iE "^batch|moe|dense|floor" "$OUT/decode_stored.log" | head -14
fi
if has convert; then
  { lscpu | grep -i "model name"; grep -c sha_ni /proc/cpuinfo; } >> "$OUT/gpu.txt" 2>&1
  step convert_2c 170 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda \
    --copies copy-safetensors,copy-safetensors+fsync,copy-files --sizes 2 --repeats 2 --out "$OUT/convert_2c.json"
  step build_2 60 "${BUILD_CHECKPOINT[@]}" /tmp/r12src2 2
  step profile_2c 60 taskset -c 0,1 python benchmarks/convert_profile.py --device cpu --max-shard-size 512MB \
    --src /tmp/r12src2 --out "$OUT/profile_2c.json"
  step convert_16c_8 200 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu,cuda \
    --copies copy-safetensors,copy-safetensors+fsync,copy-files --sizes 8 --out "$OUT/convert_16c_8.json"
  grep -h "warm convert\|warm copy\|GB checkpoint" "$OUT"/convert_*.log | cut -c1-160
  grep -v "longest\|journal writes" "$OUT/profile_2c.log" | tail -16
fi
if has convmap; then
  { lscpu | grep -i "model name"; grep -c sha_ni /proc/cpuinfo; } >> "$OUT/gpu.txt" 2>&1
  step convmap_2c 200 taskset -c 0,1 "${CONVERT_THROUGHPUT[@]}" --devices cpu --variants "pread@cpu:PORTER_SOURCE_MAP=0" \
    --copies copy-safetensors,copy-safetensors+fsync,copy-files --sizes 2 --repeats 2 --out "$OUT/convmap_2c.json"
  step build_2 60 "${BUILD_CHECKPOINT[@]}" /tmp/r12src2 2
  for v in 1 0; do
    step profile_2c_map$v 60 env PORTER_SOURCE_MAP=$v taskset -c 0,1 python benchmarks/convert_profile.py --device cpu \
      --max-shard-size 512MB --src /tmp/r12src2 --out "$OUT/profile_2c_map$v.json"
  done
  step convmap_16c_8 200 taskset -c 0-15 "${CONVERT_THROUGHPUT[@]}" --devices cpu --variants "pread@cpu:PORTER_SOURCE_MAP=0" \
    --copies copy-safetensors,copy-files --sizes 8 --out "$OUT/convmap_16c_8.json"
  grep -h "warm convert\|warm copy\|GB checkpoint" "$OUT"/convmap_*.log | cut -c1-200
  for v in 1 0; do grep -v "longest\|journal writes" "$OUT/profile_2c_map$v.log" | grep -E "cpu:|core-s" | cut -c1-110; done
fi
pack r12
