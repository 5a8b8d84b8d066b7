#!/usr/bin/env bash
# H200 calls (round 14). splitab, prefab, diag and diag4 need commit dd43c91, gemv commit e5aa719 and fout commit
# 6fd2fdc (the split-I decode kernel and its switches were taken out again after these measurements: slower than
# the two launches). STEPS picks what one call runs (logs to $OUT):
#   splitab   benchmarks/moe_knob_ab.py at T = 1, 2, 4: the two-launch decode tiles against the one-launch split-I
#             kernel (moe_split_i_kernel) over chunk width (bn1 32/64/128), GEMM2 columns per step (bn2 128/256/512),
#             GEMM1 K step (bk1 128/256), 4/8 warps and 3/4 stages; interleaved rounds, per-kernel times
#   prefab    split-I with and without the GEMM2 phase's hand prefetch (SPLIT_I_PREFETCH), wider GEMM2 steps, 8 warps
#   diag      split-I phase costs at T = 1 (SPLIT_I_DIAG: 1 no GEMM2 weight stream, 2 GEMM1 phase dead, 3 no per-step atomics)
#   gemv      split-I with the one-token GEMM2 phase as a GEMV (SPLIT_I_GEMV), and DIAG 5 (no GEMM2 phase)
#   fout      the one-token fused output off / on (FUSED_OUT_ONE_TOKEN), DIAG 5 / 6 (no counter), kernel_regs.py
#   race      benchmarks/fused_out_race.py: the fused output at T = 2, 3, 4, which tiles go wrong and how
#   fused4    the fused output at 2-4 tokens: fused_out_race.py with 2000 calls (both weight layouts), and
#             FUSED_OUT_NOSORT_TOKENS 1 / 4 timed (moe_knob_ab.py; the switch needs commit e9827e8)
#   race1     fused_out_race.py at one token (the shipped default), 20000 calls per weight layout and PDL setting
#   xstep     (needs commit bfe1457) one token without the prep kernel (X_STEP_SCALE): the MoE GPU tests, the A/B, the layer table with it
#             off and on (twin ratios)
#   layer     the MoE layer table at T = 1, 2, 4, 16, 64 (split-I on by default for T <= 4), with its bf16 twin
#   moetests  tests/test_triton_moe.py on the GPU
#   gputests  every GPU test file (MoE kernels, mxfp8 Triton, runtime decode, end to end, convert, verify)
#   OUT=/tmp/out STEPS="splitab layer" bash benchmarks/round14_call.sh
set -u
OUT=${OUT:-/tmp/r14}
STEPS=${STEPS:-splitab}
source "$(dirname "$0")/gpu_steps.sh"
S=False,False,0,True
if has splitab; then
  step split_ab 300 python benchmarks/moe_knob_ab.py --knob USE_PDL --values None --tokens 1,2,4 --rounds 3 --kernels \
    --configs "16,32,256,4,3,64,256,4,3;16,64,256,4,3,256,64,4,3,$S;16,32,256,4,3,256,32,4,3,$S;16,128,256,4,3,256,128,4,3,$S;16,64,256,8,3,256,64,4,3,$S;16,64,256,4,4,256,64,4,3,$S;16,64,256,4,3,128,64,4,3,$S;16,64,256,4,3,512,64,4,3,$S;16,64,128,4,3,256,64,4,3,$S" \
    --out "$OUT/split_ab.json"
  grep -E "^T=|kernels|bandwidth" "$OUT/split_ab.log" | cut -c1-220 | head -60
fi
if has prefab; then
  step prefetch_ab 300 python benchmarks/moe_knob_ab.py --knob SPLIT_I_PREFETCH --values False,True --tokens 1,4 --rounds 3 \
    --configs "16,32,256,4,3,64,256,4,3;16,64,256,4,3,256,64,4,3,$S;16,64,256,8,3,512,64,4,3,$S;16,64,256,8,3,1024,64,4,3,$S;16,128,256,8,3,512,128,4,3,$S;16,32,256,8,3,1024,32,4,3,$S" \
    --out "$OUT/prefetch_ab.json"
  grep -E "^T=|bandwidth" "$OUT/prefetch_ab.log" | cut -c1-200 | head -40
fi
if has diag; then  # SPLIT_I_DIAG 1: GEMM2 phase without its weight stream, 2: act zero (GEMM1 phase dead), 3: one atomic step
  step diag_ab 200 python benchmarks/moe_knob_ab.py --knob SPLIT_I_DIAG --values 0,1,2,3 --tokens 1 --rounds 3 --kernels \
    --configs "16,64,256,8,3,512,64,4,3,$S" --out "$OUT/diag_ab.json"
  grep -E "^T=|kernels" "$OUT/diag_ab.log" | cut -c1-200 | head -20
fi
if has diag4; then  # SPLIT_I_DIAG 4: the GEMM2 phase reads a contiguous [H, chunk] slab per program (wrong values, timing)
  step diag4_ab 240 python benchmarks/moe_knob_ab.py --knob SPLIT_I_DIAG --values 0,4,1 --tokens 1,4 --rounds 3 --kernels \
    --configs "16,32,256,4,3,64,256,4,3;16,64,256,4,3,512,64,4,3,$S;16,64,256,4,3,256,64,4,3,$S;16,128,256,4,3,256,128,4,3,$S;16,128,256,8,3,512,128,4,3,$S" \
    --out "$OUT/diag4_ab.json"
  grep -E "^T=|kernels" "$OUT/diag4_ab.log" | cut -c1-200 | head -70
fi
if has gemv; then  # SPLIT_I_GEMV 1 / 2: the one-token GEMM2 phase as a GEMV in fp32 / fp16 products; then DIAG 5 (no GEMM2 phase)
  step gemv_ab 300 python benchmarks/moe_knob_ab.py --knob SPLIT_I_GEMV --values 0,1,2 --tokens 1 --rounds 3 --kernels \
    --configs "16,32,256,4,3,64,256,4,3;16,64,256,4,3,512,64,4,3,$S;16,64,256,4,3,256,64,4,3,$S;16,128,256,8,3,512,128,4,3,$S;16,128,256,4,3,256,128,4,3,$S;16,64,256,8,3,1024,64,4,3,$S;16,32,256,4,3,512,32,4,3,$S" \
    --out "$OUT/gemv_ab.json"
  grep -E "^T=|kernels" "$OUT/gemv_ab.log" | cut -c1-200 | head -70
  step diag5_ab 120 python benchmarks/moe_knob_ab.py --knob SPLIT_I_DIAG --values 0,5 --tokens 1 --rounds 3 --kernels \
    --configs "16,32,256,4,3,64,256,4,3;16,64,256,4,3,512,64,4,3,$S;16,128,256,8,3,512,128,4,3,$S;16,32,256,4,3,512,32,4,3,$S" --out "$OUT/diag5_ab.json"
  grep -E "^T=|kernels" "$OUT/diag5_ab.log" | cut -c1-200 | head -30
fi
if has fout; then  # the one-token fused output (last arriver) off / on, split-I DIAG 5 (no GEMM2 phase) and 6 (no counter)
  C="16,32,256,4,3,64,256,4,3;16,32,256,4,3,512,32,4,3,$S;16,64,256,4,3,512,64,4,3,$S;16,128,256,8,3,512,128,4,3,$S"
  step fout_ab 200 python benchmarks/moe_knob_ab.py --knob FUSED_OUT_ONE_TOKEN --values True,False --tokens 1 --rounds 3 \
    --kernels --configs "$C" --out "$OUT/fout_ab.json"
  step diag56_ab 200 python benchmarks/moe_knob_ab.py --knob SPLIT_I_DIAG --values 0,5,6 --tokens 1 --rounds 3 \
    --kernels --configs "$C" --out "$OUT/diag56_ab.json"
  step regs 120 python benchmarks/kernel_regs.py --configs "$C"
  grep -hE "^T=|kernels" "$OUT/fout_ab.log" "$OUT/diag56_ab.log" | cut -c1-150 | head -60
  grep -E "regs" "$OUT/regs.log" | cut -c1-260
fi
if has race; then  # the fused output with several tokens: which tiles go wrong, and how
  step race 300 python benchmarks/fused_out_race.py --tokens 2,3,4 --calls 200
  cat "$OUT/race.log" | cut -c1-220 | head -80
fi
if has fused4; then  # the fused output for 2-4 tokens: 2000 calls each way, then its speed against prep zeroing + cast
  step race2000 300 python benchmarks/fused_out_race.py --tokens 2,3,4 --calls 2000 --layouts rebased,stored
  grep -E "^(rebased|stored)|call " "$OUT/race2000.log" | cut -c1-220 | head -40
  step fused4_ab 200 python benchmarks/moe_knob_ab.py --knob FUSED_OUT_NOSORT_TOKENS --values 1,4 --tokens 1,2,3,4 \
    --rounds 5 --kernels --out "$OUT/fused4_ab.json"
  grep -E "^T=|kernels" "$OUT/fused4_ab.log" | cut -c1-200 | head -20
fi
if has race1; then  # the one-token fused output (the default) under many calls, both weight layouts
  step race1 300 python benchmarks/fused_out_race.py --tokens 1 --calls 20000 --layouts rebased,stored
  grep -E "^(rebased|stored)|call " "$OUT/race1.log" | cut -c1-220 | head -30
fi
if has xstep; then  # one token without the prep kernel: GEMM1 scales x per K step (X_STEP_SCALE)
  step xstep_tests 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/xstep_tests.log" | head -12
  step xstep_ab 150 python benchmarks/moe_knob_ab.py --knob X_STEP_SCALE --values False,True --tokens 1,2,4 --rounds 5 \
    --kernels --out "$OUT/xstep_ab.json"
  grep -E "^T=|kernels" "$OUT/xstep_ab.log" | cut -c1-200 | head -14
  for v in 0 1; do
    step xstep_layer_$v 120 env PORTER_MOE_X_STEP_SCALE=$v python benchmarks/moe_layer.py --out "$OUT/l$v" \
      --tag _round14_xstep$v --tokens 1,4,16
    grep -E "^T=" "$OUT/xstep_layer_$v.log" | cut -c1-200
  done
fi
if has layer; then
  step layer 240 python benchmarks/moe_layer.py --out "$OUT" --tag _round14 --tokens 1,2,4,16,64
  grep -E "^T=|GPU|bandwidth" "$OUT/layer.log" | cut -c1-200 | head -30
fi
if has moetests; then
  step moe_tests 420 python -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/moe_tests.log" | head -16
fi
if has gputests; then
  step gpu_tests 540 python -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py tests/test_mxfp8_triton.py \
    tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py tests/test_convert.py tests/test_verify_gpu.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/gpu_tests.log" | head -16
fi
pack r14
