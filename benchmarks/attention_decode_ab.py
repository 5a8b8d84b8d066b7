"""A/B of the decode attention at MiniMax-M3's real dims (64 q / 4 kv heads, head_dim 128, indexer 4 x 128,
block 128, top-16), per (batch, cached tokens): sparse, the top-k picked inside the split-K kernel from
the indexer's block scores (scores, split-K, merge: 3 launches) against the index_topk kernel before it
(4 launches); dense: the attention alone. Key tiles of 128 against the shipped 64 were measured with this
script before (benchmarks/results/attention_ab_round6_final.log) and are not run any more.

Sparse cases time the indexer's block scores + the attention (what follows decode_qkv in a sparse layer);
dense cases the attention alone. Each timed CUDA graph cycles through enough cache copies (>= 200 MB)
that no call finds its keys in L2, as in a decode step that streams the weights between two layers'
attention. Prints µs per call and the in-kernel top-k output's relative difference to the index_topk one.

    python benchmarks/attention_decode_ab.py --out benchmarks/results/attention_decode_ab.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gemv_stream_ab import rotating_ms  # noqa: E402
from runtime.kernels import attention as A  # noqa: E402
from runtime.kernels import fused  # noqa: E402

NQ, NKV, D, NI, DI, BLOCK, TOPK = 64, 4, 128, 4, 128, 128, 16
CASES = [("sparse", 1, 8192), ("sparse", 8, 8192), ("dense", 1, 1024), ("dense", 1, 8192), ("dense", 32, 1024)]


def case_inputs(B: int, kv: int, copies: int):
    """Per copy: q, K/V caches, index q, index-key cache (as decode.py's filled cache: kv + 128 slots)."""
    slots = kv + BLOCK
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    return [(r(B, NQ, D), r(B, NKV, slots, D), r(B, NKV, slots, D), r(B, NI, DI), r(B, slots, DI))
            for _ in range(copies)]


def attention_fn(kind: str, inputs, pos, slots: int, in_kernel: bool):
    """fn(i) -> attention output of copy i (sparse: block scores first)."""
    def run(i):
        q, k, v, iq, ik = inputs[i]
        if kind == "dense":
            return A._decode_attention_triton(q, k, v, pos, slots, None, BLOCK, D ** -0.5)[0]
        scores = fused.index_scores(iq, ik, pos, slots, BLOCK, 1, 0)
        if in_kernel:
            return A._decode_attention_triton(q, k, v, pos, slots, None, BLOCK, D ** -0.5, scores=scores, topk=TOPK)[0]
        top = fused.index_topk(scores, TOPK)
        return A._decode_attention_triton(q, k, v, pos, slots, top, BLOCK, D ** -0.5)[0]
    return run


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for kind, B, kv in CASES:
        slots = kv + BLOCK
        per_copy = B * slots * (2 * NKV * D + DI) * 2
        copies = max(2, -(-200_000_000 // per_copy))
        inputs = case_inputs(B, kv, copies)
        pos = torch.full((B,), kv, device="cuda")
        base = attention_fn(kind, inputs, pos, slots, False)
        rows = {"topk kernel" if kind == "sparse" else "attention": rotating_ms(base, copies)}
        if kind == "sparse":
            fn = attention_fn(kind, inputs, pos, slots, True)
            want = base(0).float()
            rows["in-kernel top-k"] = rotating_ms(fn, copies)
            rows["in-kernel top-k rel"] = float((fn(0).float() - want).norm() / want.norm())
        line = ", ".join(f"{k} {v:.2f}" if "rel" not in k else f"{k} {v:.1e}" for k, v in rows.items())
        print(f"{kind} B={B} KV={kv} ({copies} cache copies), us: {line}", flush=True)
        doc["rows"].append({"kind": kind, "batch": B, "kv": kv, "copies": copies, "us": rows})
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
