#!/usr/bin/env bash
# H200 call (round 6, MoE): PREP_PDL A/B at decode sizes, FP8_ROW_SCALE A/B with four FP8 tiles at prefill
# sizes, the decode benchmark at batch 1, the MoE GPU tests. Logs to $OUT.
# PREP_PDL was removed after this call (PDL on the prep kernel measured slower): at later commits its
# step exits with "runtime.moe.triton_backend has no PREP_PDL". Results: benchmarks/results/moe_round6_*.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 100 python benchmarks/moe_knob_ab.py --knob PREP_PDL --values True,False --out $OUT/prep_pdl_ab.json \
  > $OUT/prep_pdl_ab.log 2>&1; echo "prep ab rc=$?"; grep "^T=" $OUT/prep_pdl_ab.log
timeout 200 python benchmarks/moe_knob_ab.py --knob FP8_ROW_SCALE --values False,True --tokens 1024,4096 --rounds 2 \
  --configs "64,64,128,4,3,128,128,4,3,False,False,2;128,64,128,8,3,128,128,8,3,False,False,2;64,64,128,4,4,128,128,4,4,False,False,2;128,128,128,8,3,128,128,8,3,False,False,2" \
  --out $OUT/fp8_row_ab.json > $OUT/fp8_row_ab.log 2>&1; echo "fp8 ab rc=$?"; grep "^T=\|Error\|error" $OUT/fp8_row_ab.log | head -40
timeout 50 python benchmarks/decode.py --workdir /tmp/m3-decode --out $OUT/dec --layers 2 --experts 8 --scopes experts \
  --cases 1x1024,1x8192 --prefill-tokens 0 > $OUT/decode.log 2>&1; echo "decode rc=$?"; grep "^| 1 " $OUT/decode.log
timeout 150 python -m pytest -q -m gpu tests/test_triton_moe.py > $OUT/moe_tests.log 2>&1; echo "tests rc=$?"
tail -2 $OUT/moe_tests.log
