#!/usr/bin/env bash
# Round 6's last H200 call, most important first: the GPU tests of everything changed since the last GPU run
# (decode attention with PDL, the FP8 per-row weight scale, conversion), `porter verify` at real dims with and
# without FP8 prefill, then the decode benchmark (default; in-kernel top-k at batch 1), the attention A/B and
# the --device cuda / cpu conversion A/B of Python's thread switch interval. Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/round6_final.sh
# PORTER_SWITCH_INTERVAL (the switch interval A/B) was removed after this call: it changed nothing measurable,
# so at later commits its variants run porter's defaults. Results: benchmarks/results/*round6_final*.
set -u
OUT=${OUT:-/tmp/final-out}
source "$(dirname "$0")/gpu_steps.sh"
step decode_tests 100 python -m pytest -q -m gpu tests/test_runtime_gpu_decode.py tests/test_gpu_end_to_end.py
step convert_verify_tests 35 python -m pytest -q -m gpu tests/test_convert.py tests/test_verify_gpu.py
step moe_fp8_tests 50 python -m pytest -q -m gpu tests/test_triton_moe.py -k "fp8 or rebase"
step verify_fp8_prefill 100 python benchmarks/verify_fp8_prefill.py --out "$OUT/verify_fp8_prefill.json"
bench="python benchmarks/decode.py --workdir /tmp/m3-decode --layers 2 --experts 8 --scopes experts --prefill-tokens 0"
step decode_bench 35 $bench --out "$OUT/d"
step decode_topk_in_kernel 20 env PORTER_ATTENTION_TOPK=1 $bench --out "$OUT/d_topk" --cases 1x1024,1x8192
step attention_ab 30 python benchmarks/attention_decode_ab.py --out "$OUT/attention_ab.json"
step convert_si 90 taskset -c 0-15 python benchmarks/convert_throughput.py --sizes 8 --devices cuda,cpu --no-single \
  --max-shard-size 512MB --copies copy-safetensors,copy-files \
  --variants "si05@cuda:PORTER_SWITCH_INTERVAL=0.0005;si01@cuda:PORTER_SWITCH_INTERVAL=0.0001;si05@cpu:PORTER_SWITCH_INTERVAL=0.0005" \
  --out "$OUT/convert_si.json"
