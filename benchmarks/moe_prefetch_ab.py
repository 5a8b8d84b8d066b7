"""A/B of the NOSORT path's L2 prefetch before the PDL wait (triton_backend.PREFETCH) at MiniMax-M3 dims,
one H200: the whole routed layer at T = 1, 2, 4 (CUDA-graph replay queued behind GPU work, median of
interleaved rounds so clock drift hits every variant alike), per variant against the no-prefetch default,
each output checked against the default's (the prefetch is a hint: the math is unchanged, only the
order of GEMM2's fp32 atomics may differ) and against the torch reference. The floor is the touched
weight + scale bytes at the streaming bandwidth measured in the same run.

  python3 benchmarks/moe_prefetch_ab.py [--tokens 1,2,4] [--rounds 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import EXPERT_BYTES, build_layer, decode_problem, graph_time_queued_us, stream_bandwidth  # noqa: E402
from runtime.moe import triton_backend as tb  # noqa: E402

VARIANTS = {  # name -> (gemm1 bytes per row, gemm2 bytes per row, GEMM1 signals GEMM2's launch)
    "none": (0, 0, False),
    "launch_next": (0, 0, True),
    "g2_512": (0, 512, True),
    "g2_1k": (0, 1024, True),
    "g2_2k": (0, 2048, True),
    "g2_1k_no_launch": (0, 1024, False),
    "g1_256": (256, 0, False),
    "g1_512": (512, 0, False),
    "g1_512_g2_1k": (512, 1024, True),
    "g1_256_g2_512": (256, 512, True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = stream_bandwidth(dev)["used"]
    moe, ref_moe, _, _ = build_layer(dev)
    names = args.variants.split(",")
    res = {"bandwidth_Bps": bw, "variants": {n: VARIANTS[n] for n in names}, "rows": []}
    print(f"{torch.cuda.get_device_name(dev)}, streaming bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for t in [int(v) for v in args.tokens.split(",")]:
        x, ids, w = decode_problem(t, dev)
        floor_us = int(torch.unique(ids).numel()) * EXPERT_BYTES / bw * 1e6
        ref = ref_moe.forward_topk(x, ids, w).float()
        times = {n: [] for n in names}
        outs = {}
        for _ in range(args.rounds):
            for n in names:
                tb.PREFETCH = VARIANTS[n]
                f = lambda: moe.forward_topk(x, ids, w)
                times[n].append(graph_time_queued_us(f))
                outs[n] = f().float()
        tb.PREFETCH = None
        base = statistics.median(times[names[0]])
        for n in names:
            us = statistics.median(times[n])
            row = {"T": t, "variant": n, "us": us, "x_floor": us / floor_us, "vs_first": us / base,
                   "rel_vs_first": float((outs[n] - outs[names[0]]).norm() / outs[names[0]].norm()),
                   "rel_vs_torch": float((outs[n] - ref).norm() / ref.norm()), "rounds_us": times[n]}
            res["rows"].append(row)
            print(f"T={t} {n:18s} {us:7.1f} us  {row['x_floor']:.3f}x floor ({floor_us:.1f} us)  "
                  f"{row['vs_first']:.3f}x {names[0]}  rel vs {names[0]} {row['rel_vs_first']:.1e}  "
                  f"vs torch {row['rel_vs_torch']:.1e}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
