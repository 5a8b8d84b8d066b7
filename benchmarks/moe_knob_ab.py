"""A/B of one triton_backend module switch (e.g. FP8_ROW_SCALE) on the whole routed MoE layer at MiniMax-M3
dims, one GPU: CUDA-graph replay queued behind GPU work, median of interleaved rounds (drift hits every
value alike), each value's output against the first value's and the torch reference. The floor is the
touched weight + scale bytes at the streaming bandwidth measured in the same run.

  python3 benchmarks/moe_knob_ab.py --knob FP8_ROW_SCALE --values False,True --tokens 1024,4096 [--rounds 3]
      [--configs "64,64,128,4,3,128,128,4,3,False,False,2;..."]  (MoeConfig fields; default: default_config)
      [--kernels]  (also each variant's device time per kernel, torch.profiler: where the time goes)
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import EXPERT_BYTES, build_layer, decode_problem, graph_time_queued_us, kernel_times, stream_bandwidth  # noqa: E402
from runtime.moe import triton_backend as tb  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--knob", required=True)
    ap.add_argument("--values", required=True, help="comma list of Python literals")
    ap.add_argument("--tokens", default="1,2,4,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="", help="';'-separated MoeConfig field lists, each timed per value")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not hasattr(tb, args.knob):
        sys.exit(f"runtime.moe.triton_backend has no {args.knob}")
    values = [ast.literal_eval(v) for v in args.values.split(",")]
    configs = [tb.MoeConfig(*ast.literal_eval(f"({c},)")) for c in args.configs.split(";") if c] or [None]
    variants = [(v, c) for c in configs for v in values]  # (knob value, config or None)
    dev = torch.device("cuda")
    bw = stream_bandwidth(dev)["used"]
    moe, ref_moe, _, _ = build_layer(dev)
    keep = getattr(tb, args.knob)
    res = {"knob": args.knob, "bandwidth_Bps": bw, "gpu": torch.cuda.get_device_name(dev), "rows": []}
    print(f"{res['gpu']}, streaming bandwidth {bw / 1e12:.2f} TB/s; {args.knob} in {values}", flush=True)
    for t in [int(v) for v in args.tokens.split(",")]:
        x, ids, w = decode_problem(t, dev)
        floor_us = int(torch.unique(ids).numel()) * EXPERT_BYTES / bw * 1e6
        ref = ref_moe.forward_topk(x, ids, w).float()
        times, outs = [[] for _ in variants], [None] * len(variants)
        failed = {}
        for _ in range(args.rounds):
            for i, (v, c) in enumerate(variants):
                if i in failed:
                    continue
                setattr(tb, args.knob, v)
                f = lambda c=c: moe.forward_topk(x, ids, w, c)
                try:
                    times[i].append(graph_time_queued_us(f))
                    outs[i] = f().float()
                except Exception as exc:  # a variant that does not compile or run is reported, not fatal
                    failed[i] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    print(f"T={t} {args.knob}={v!r} {c}: FAILED {failed[i]}", flush=True)
        setattr(tb, args.knob, keep)
        rel = lambda a, b: float((a - b).norm() / b.norm())
        ok = [i for i in range(len(variants)) if i not in failed]
        if not ok:
            continue
        base, first = statistics.median(times[ok[0]]), outs[ok[0]]  # the first variant that ran
        for i, (v, c) in enumerate(variants):
            if i in failed:
                res["rows"].append({"T": t, "value": repr(v), "config": c and c.__dict__, "failed": failed[i]})
                continue
            us = statistics.median(times[i])
            row = {"T": t, "value": repr(v), "config": c and c.__dict__, "us": us, "x_floor": us / floor_us,
                   "vs_first": us / base, "rel_vs_first": rel(outs[i], first), "rel_vs_torch": rel(outs[i], ref),
                   "rounds_us": times[i]}
            if args.kernels:
                setattr(tb, args.knob, v)
                row["kernels_us"] = kernel_times(lambda c=c: moe.forward_topk(x, ids, w, c))
                setattr(tb, args.knob, keep)
            res["rows"].append(row)
            tile = "" if c is None else (f" cfg {c.bm}/{c.bn1}/{c.bk1}/{c.warps1}w{c.stages1}s-{c.bn2}/{c.bk2}/"
                                         f"{c.warps2}w{c.stages2}s{' swap' * (c.swap1 or c.swap2)}")
            print(f"T={t} {args.knob}={v!r:8}{tile} {us:8.1f} us  {row['x_floor']:.3f}x floor ({floor_us:.1f} us)  "
                  f"{row['vs_first']:.3f}x first  rel vs first {row['rel_vs_first']:.1e}  "
                  f"vs torch {row['rel_vs_torch']:.1e}", flush=True)
            if args.kernels:
                print("    kernels us: " + " ".join(f"{k} {v:.1f}" for k, v in row["kernels_us"].items()), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
