#!/usr/bin/env bash
# NOT RUN in round 11 (the device refused new machines after call 2); its steps ran in round 12 as
# benchmarks/round12_call.sh STEPS="layer decode".
# H200 call (round 11, 3): the record on the rebased default. STEPS="layer" : the MoE layer benchmark at
# MiniMax-M3 dims over T = 1..4096 with 512 and 768 added (where the FP8 prefill path starts to win);
# STEPS="decode": the decode step at real layer dims (benchmarks/decode.py) with the experts rebased at
# load and as stored (PORTER_MOE_REBASE=0). Logs to $OUT.
#   OUT=/tmp/out STEPS=layer bash benchmarks/round11_moe_call3.sh
set -u
OUT=${OUT:-/tmp/r11-moe3}
STEPS=${STEPS:-layer decode}
source "$(dirname "$0")/gpu_steps.sh"
if [[ $STEPS == *layer* ]]; then
  step layer 500 python benchmarks/moe_layer.py --out "$OUT" --tag _round11 --tokens 1,4,16,64,256,512,768,1024,4096
  grep -E "^T=|GPU|bandwidth" "$OUT/layer.log" | head -30
fi
if [[ $STEPS == *decode* ]]; then
  bench="python benchmarks/decode.py --workdir /tmp/m3-decode --layers 2 --experts 8 --scopes experts --prefill-tokens 0"
  step decode_rebased 200 $bench --out "$OUT/d" --cases 1x1024,1x8192,8x1024,32x1024
  grep -iE "^batch|moe|dense|floor" "$OUT/decode_rebased.log" | head -14
  step decode_stored 150 env PORTER_MOE_REBASE=0 $bench --out "$OUT/d_stored" --cases 1x1024,1x8192,8x1024,32x1024
  grep -iE "^batch|moe|dense|floor" "$OUT/decode_stored.log" | head -14
fi
