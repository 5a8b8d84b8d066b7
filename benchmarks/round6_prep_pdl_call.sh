#!/usr/bin/env bash
# H200 call: PREP_PDL A/B on the routed layer, decode benchmark at batch 1, the MoE GPU tests. Logs to $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python benchmarks/moe_knob_ab.py --knob PREP_PDL --values True,False --out $OUT/prep_pdl_ab.json \
  > $OUT/prep_pdl_ab.log 2>&1; echo "ab rc=$?"; grep "^T=" $OUT/prep_pdl_ab.log
timeout 60 python benchmarks/decode.py --workdir /tmp/m3-decode --out $OUT/dec --layers 2 --experts 8 --scopes experts \
  --cases 1x1024,1x8192 --prefill-tokens 0 > $OUT/decode.log 2>&1; echo "decode rc=$?"; grep "^| 1 " $OUT/decode.log
timeout 150 python -m pytest -q -m gpu tests/test_triton_moe.py > $OUT/moe_tests.log 2>&1; echo "tests rc=$?"
tail -2 $OUT/moe_tests.log
