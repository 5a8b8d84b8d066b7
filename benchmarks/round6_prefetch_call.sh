set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python benchmarks/moe_prefetch_ab.py --rounds 3 --out $OUT/moe_prefetch_ab.json > $OUT/moe_prefetch_ab.log 2>&1; echo "ab rc=$?"
grep "^T=" $OUT/moe_prefetch_ab.log; tail -3 $OUT/moe_prefetch_ab.log
for v in 0,0,0 0,1024,1 256,512,1; do
  PORTER_MOE_PREFETCH=$v timeout 60 python benchmarks/decode.py --workdir /tmp/m3-decode --out $OUT/dec_$v --layers 2 --experts 8 \
    --scopes experts --cases 1x1024,1x8192 --prefill-tokens 0 > $OUT/decode_$v.log 2>&1; echo "decode $v rc=$?"
  grep "^| 1 " $OUT/decode_$v.log
done
timeout 100 python -m pytest -q -m gpu tests/test_triton_moe.py -k "nosort or fused_out or last_arriver or decode" > $OUT/moe_tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/moe_tests.log
