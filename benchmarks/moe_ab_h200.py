"""A/B of tile configs for the Triton MXFP8 MoE on one GPU (tuning aid; one device call).

For each T: the whole layer (CUDA-graph replay median) and per-kernel device times (torch.profiler)
for a list of MoeConfig candidates, the bf16-weight twin with the default config, and the current
default (FP8 prefill on). diff = rel difference to the W8A16 path. Prints a table per T and writes
bench_ab_<gpu>.json into --out.

  python3 benchmarks/moe_ab_h200.py [--out DIR] [--tokens 1,4,16,64,256,4096]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import (EXPERT_BYTES, H, I, RSF, build_layer, decode_problem, graph_time_us, kernel_times,  # noqa: E402
                       stream_bandwidth)
from runtime.moe import triton_backend as tb  # noqa: E402

C = tb.MoeConfig
# bm, bn1, bk1, warps1, stages1, bn2, bk2, warps2, stages2, swap1, swap2, fp8


def candidates(t):
    """(name, config or None = default, path options) per T."""
    if t <= 4:  # decode: 4 pipeline stages in either GEMM
        return [("two_g1s4", C(16, 32, 256, 4, 4, 64, 256, 4, 3), {}),
                ("two_g2s4", C(16, 32, 256, 4, 3, 64, 256, 4, 4), {})]
    if t < 256:  # sorted decode path: bytes in flight per SM and row-segment length of the weight stream
        return [("bk512_w8s4", C(16, 32, 512, 8, 4, 64, 512, 8, 4), {}),
                ("bk512_g2only", C(16, 32, 256, 4, 4, 64, 512, 4, 4), {}),
                ("bn64_w8s4", C(16, 64, 256, 8, 4, 128, 256, 8, 4), {})]
    return [("w8a16", tb.default_config(t, False), {}),
            ("fp8x2_64", C(64, 64, 128, 4, 3, 128, 128, 4, 3, fp8=2), {}),
            ("fp8x1_64", C(64, 64, 128, 4, 3, 128, 128, 4, 3, fp8=1), {}),
            ("fp8x2_64s4", C(64, 64, 128, 4, 4, 128, 128, 4, 4, fp8=2), {}),
            ("fp8x2_128", C(128, 64, 128, 8, 3, 128, 128, 8, 3, fp8=2), {}),
            ("fp8x2_128s4", C(128, 64, 128, 8, 4, 128, 128, 8, 4, fp8=2), {}),
            ("fp8x2_wide", C(64, 128, 128, 8, 4, 256, 128, 8, 4, fp8=2), {})]


def call(prepared, x, ids, w, cfg, opts):
    tb.USE_PDL = opts.get("pdl", None)
    kw = {k: v for k, v in opts.items() if k != "pdl"}
    return lambda: tb.fused_moe(prepared, x, ids, w, RSF, cfg, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/tmp_ab"))
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    moe, _, bf16, _ = build_layer(dev)
    print(f"weights {time.time() - t0:.1f}s wmode {moe.prepared.wmode1} {moe.prepared.wmode2}", flush=True)
    bw = stream_bandwidth(dev)["used"]  # the bytes floor's rate, measured in this run
    print(f"bf16 streaming read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    results = []
    for t in [int(v) for v in args.tokens.split(",")]:
        torch.manual_seed(t)
        x, ids, w = decode_problem(t, dev)
        touched = int(torch.unique(ids).numel()) * EXPERT_BYTES
        tb.USE_PDL = False
        ref = tb.fused_moe(moe.prepared, x, ids, w, RSF, tb.default_config(t, False), nosort=False,
                           fused_out=False).float()
        rows = []
        cands = [("default", None, {})] + candidates(t)
        for name, cfg, opts in cands:
            cfg = cfg or tb.default_config(t, True)
            try:
                fn = call(moe.prepared, x, ids, w, cfg, opts)
                err = float((fn().float() - ref).norm() / ref.norm())
                us = graph_time_us(fn, reps=30 if t >= 1024 else 100)
                kt = kernel_times(fn)
            except Exception as ex:  # report, keep going
                print(f"T={t} {name} {cfg} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                continue
            row = {"T": t, "name": name, "opts": opts, "cfg": tb.fit_config(cfg, H, I).__dict__, "us": us,
                   "TBps": touched / us / 1e6, "x_floor": us / (touched / bw * 1e6), "gemm1_us": kt.get("gemm1"),
                   "gemm2_us": kt.get("gemm2"), "prep_us": kt.get("prep"), "quant_rows_us": kt.get("quant_rows"),
                   "diff_vs_w8a16": err}
            rows.append(row)
            print(f"T={t:5d} {name:12s} {us:9.1f} us {row['TBps']:.2f} TB/s x{row['x_floor']:.3f} floor  g1 "
                  f"{kt.get('gemm1', 0):8.1f} g2 {kt.get('gemm2', 0):8.1f} prep "
                  f"{kt.get('prep', 0):6.1f} q {kt.get('quant_rows', 0):6.1f}  diff {err:.1e}  {opts} "
                  f"{tb.fit_config(cfg, H, I)}", flush=True)
        twins = (("bf16", {}),)
        if os.environ.get("AB_NO_TWIN"):  # the twins are in benchmarks/moe_layer.py's table of the same run
            twins = ()
        for name, opts in twins:
            try:
                fb = call(bf16, x, ids, w, tb.default_config(t, False), opts)
                us = graph_time_us(fb, reps=30 if t >= 1024 else 100)
                err = float((fb().float() - ref).norm() / ref.norm())
                rows.append({"T": t, "name": name, "us": us, "x_floor_bf16_bytes": us / (2 * touched / bw * 1e6),
                             "diff_vs_w8a16": err})
                print(f"T={t:5d} {name:12s} {us:9.1f} us  diff {err:.1e}", flush=True)
            except Exception as ex:
                print(f"T={t} {name} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
            if t > 256:
                break
        tb.USE_PDL = None
        results += rows
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_ab_" + torch.cuda.get_device_name().replace(" ", "_") + ".json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
