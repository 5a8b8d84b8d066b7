#!/usr/bin/env bash
# One H200 call for the decode attention's in-kernel top-k: the decode benchmark with it (the default) and
# without it (PORTER_ATTENTION_TOPK=0: the index_topk kernel, batch 1), the GPU decode tests of the
# attention, indexer and decode step, and the attention A/B (benchmarks/attention_decode_ab.py). Logs to $OUT.
#   OUT=/tmp/out bash benchmarks/attention_round6.sh
set -u
OUT=${OUT:-/tmp/attention-out}
source "$(dirname "$0")/gpu_steps.sh"
bench="python benchmarks/decode.py --workdir /tmp/m3-decode --layers 2 --experts 8 --scopes experts --prefill-tokens 0"
step decode ${TBENCH:-50} $bench --out "$OUT/d_topk_in_kernel"
step decode_tests ${TTESTS:-60} python -m pytest -q -m gpu tests/test_runtime_gpu_decode.py \
  -k "attention or index or fused_decode or cuda_graph or decode_qkv or overlap"
step decode_topk_kernel ${TBENCH2:-30} env PORTER_ATTENTION_TOPK=0 $bench --out "$OUT/d_topk_kernel" \
  --cases 1x1024,1x8192
step attention_ab ${TAB:-30} python benchmarks/attention_decode_ab.py --out "$OUT/attention_ab.json"
