#!/usr/bin/env bash
# H200 calls (round 18): the one-token layer as one persistent launch (one_token_persistent_kernel,
# PERSIST_ONE_TOKEN) against the two launches. Needs commit 9ce7bc8: the kernel and its switches were taken out
# again after these measurements (slower than the two launches in every setting; docs/moe-backends.md).
# STEPS picks what one call runs (logs to $OUT):
#   pab       benchmarks/moe_knob_ab.py at T = 1: PERSIST_ONE_TOKEN False / True over tiles (the persistent kernel
#             takes warps and stages from GEMM1's fields), interleaved rounds, per-kernel times
#   persm     PERSIST_PROGRAMS_PER_SM 1..4 at T = 1 (the persistent kernel on)
#   race1     benchmarks/fused_out_race.py at one token: every output tile of 2000 calls per weight layout and PDL
#             setting against the unfused two launches
#   moetests  tests/test_triton_moe.py on the GPU
#   layer     the MoE layer table (every T of moe_layer.py) with its bf16 twin and torch._grouped_mm
#   regs      benchmarks/kernel_regs.py: registers and shared memory of the two launches and the persistent kernel
#   pgrid     PERSIST_ONE_TOKEN False / True at 132, 192, 264 programs, items by claims and statically by program id
#   pregs     the persistent kernel with 128 / 96 / 80 registers per thread at most, 2-4 programs per SM
#   OUT=/tmp/out STEPS="pab race1" bash benchmarks/round18_call.sh
set -u
OUT=${OUT:-/tmp/r18}
STEPS=${STEPS:-pab}
source "$(dirname "$0")/gpu_steps.sh"
carried_wheels
S=False,False,0
T1="16,32,256,4,3,64,256,4,3"
if has pab; then
  step persist_ab 300 python benchmarks/moe_knob_ab.py --knob PERSIST_ONE_TOKEN --values False,True --tokens 1 --rounds 5 \
    --kernels --configs "$T1;16,32,256,4,4,64,256,4,4;16,32,256,8,3,64,256,8,3;16,32,256,4,3,32,256,4,3;16,64,256,4,3,64,256,4,3" \
    --out "$OUT/persist_ab.json"
  grep -E "^T=|kernels|bandwidth" "$OUT/persist_ab.log" | cut -c1-220 | head -40
fi
if has persm; then
  step persist_per_sm 200 python benchmarks/moe_knob_ab.py --knob PERSIST_PROGRAMS_PER_SM --values 1,2,3,4 --tokens 1 --rounds 5 \
    --configs "$T1;16,32,256,4,3,32,256,4,3" --out "$OUT/persist_per_sm.json"
  grep -E "^T=|bandwidth" "$OUT/persist_per_sm.log" | cut -c1-220 | head -20
fi
if has race1; then
  step race1 300 python benchmarks/fused_out_race.py --tokens 1 --calls 2000 --layouts rebased,stored
  grep -E "^(rebased|stored)|call " "$OUT/race1.log" | cut -c1-220 | head -30
fi
if has moetests; then
  step moe_tests 420 python -m pytest -q -p no:cacheprovider -m gpu tests/test_triton_moe.py
  grep -E "passed|failed|^FAILED|^E  " "$OUT/moe_tests.log" | head -16
fi
if has layer; then
  step layer 400 python benchmarks/moe_layer.py --out "$OUT" --tag _round18
  grep -E "^T=|GPU|bandwidth" "$OUT/layer.log" | cut -c1-200 | head -30
fi
if has regs; then
  step kernel_regs 120 python benchmarks/kernel_regs.py --configs "$T1;16,16,256,4,3,64,256,4,3"
  grep -E "regs" "$OUT/kernel_regs.log" | cut -c1-200 | head -20
fi
if has pgrid; then  # the persistent kernel over program counts, claims / static, against the two launches
  for progs in 132 192 264; do
    for static in 0 1; do
      PORTER_MOE_PERSIST_PROGRAMS=$progs PORTER_MOE_PERSIST_STATIC=$static step pgrid_${progs}_s$static 120 \
        python benchmarks/moe_knob_ab.py --knob PERSIST_ONE_TOKEN --values False,True --tokens 1 --rounds 5 \
        --configs "$T1;16,16,256,4,3,64,256,4,3" --out "$OUT/pgrid_${progs}_s$static.json"
      grep -E "^T=" "$OUT/pgrid_${progs}_s$static.log" | cut -c1-150
    done
  done
fi
if has pregs; then  # the persistent kernel with a register cap (more programs resident per SM), claims
  for cap in 128 96 80; do
    PORTER_MOE_PERSIST_MAXNREG=$cap step pregs_$cap 150 python benchmarks/moe_knob_ab.py --knob PERSIST_PROGRAMS_PER_SM \
      --values 2,3,4 --tokens 1 --rounds 5 --configs "$T1" --out "$OUT/pregs_$cap.json"
    grep -E "^T=" "$OUT/pregs_$cap.log" | cut -c1-150 | tail -3
  done
  PORTER_MOE_PERSIST_MAXNREG=96 step pregs_96_ab 120 python benchmarks/moe_knob_ab.py --knob PERSIST_ONE_TOKEN --values False,True \
    --tokens 1 --rounds 5 --kernels --configs "$T1" --out "$OUT/pregs_96_ab.json"
  grep -E "^T=|kernels" "$OUT/pregs_96_ab.log" | cut -c1-150 | tail -4
  PORTER_MOE_PERSIST_MAXNREG=96 step pregs_96_regs 120 python benchmarks/kernel_regs.py --configs "$T1"
  grep persistent "$OUT/pregs_96_regs.log" | cut -c1-80
fi
pack round18
