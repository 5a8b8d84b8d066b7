"""Decode-size (T = 1..64) A/B of the Triton MXFP8 MoE at MiniMax-M3 dims on one GPU (tuning aid).

For each T: the whole layer (CUDA-graph replay median, interleaved rounds so drift hits every variant
alike) and per-kernel device times (torch.profiler) of tile configs and path options against the
current default, each checked against the torch reference (rel error). Per kernel it prints achieved
TB/s next to a plain Triton read of the same number of bytes in this run (the size-matched floor).
At the end the per-kernel winners are combined and timed against the default, with the bf16-weight
twin (same kernels and configs on bf16 weights). Writes decode_sweep_<gpu>.json into --out.

  python3 benchmarks/moe_decode_sweep.py [--out DIR] [--tokens 1,4,16,64] [--rounds 2] [--phase2]

--phase2: the timing method itself (graph launched on an idle GPU vs queued behind GPU work, one layer
per graph vs 8 layers on different experts) for the default, the path options and deeper-K tiles.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import (H, I, E, TOPK, RSF, build_layer, decode_problem, graph_time_queued_us,  # noqa: E402
                       graph_time_us, kernel_times, read_kernel, stream_bandwidth)
from runtime.moe import triton_backend as tb  # noqa: E402

C = tb.MoeConfig
G1_BYTES = 2 * I * H * (1 + 1 / 32)  # one expert's w13 + scales
G2_BYTES = H * I * (1 + 1 / 32)


def g1_variants():
    """(name, (bn1, bk1, warps1, stages1, swap1)) for GEMM1 at one token; None: the default's."""
    return [("g1_base", None), ("g1_swap", (32, 256, 4, 3, True)), ("g1_bn16", (16, 256, 4, 3, False)),
            ("g1_bk128s4", (32, 128, 4, 4, False)), ("g1_w8", (32, 256, 8, 3, False)),
            ("g1_swap64", (64, 256, 4, 3, True)), ("g1_swap_s4", (32, 256, 4, 4, True)),
            ("g1_bk512", (32, 512, 4, 3, False)), ("g1_bn64", (64, 256, 4, 3, False)), ("g1_s4", (32, 256, 4, 4, False)),
            ("g1_w2", (32, 256, 2, 3, False))]


def g2_variants():
    return [("g2_base", None), ("g2_swap", (64, 256, 4, 3, True)), ("g2_bk128s4", (64, 128, 4, 4, False)),
            ("g2_bn128w8", (128, 256, 8, 3, False)), ("g2_swap128", (128, 256, 4, 3, True)),
            ("g2_swap_s4", (64, 256, 4, 4, True)), ("g2_w8", (64, 256, 8, 3, False)),
            ("g2_bn32", (32, 256, 4, 3, False)), ("g2_bn32s4", (32, 256, 4, 4, False)), ("g2_bk512", (64, 512, 4, 3, False)),
            ("g2_w2", (64, 256, 2, 3, False))]


def with_g1(cfg, g):
    if g is None:
        return cfg
    bn, bk, w, s, sw = g
    return replace(cfg, bn1=bn, bk1=bk, warps1=w, stages1=s, swap1=sw)


def with_g2(cfg, g):
    if g is None:
        return cfg
    bn, bk, w, s, sw = g
    return replace(cfg, bn2=bn, bk2=bk, warps2=w, stages2=s, swap2=sw)


def read_floor_us(dev, nbytes) -> float:
    """Plain Triton read-reduce of nbytes (fresh buffers per replay, so not L2-hot): the size-matched floor."""
    read = read_kernel()
    block = 8192
    n = int(nbytes // 2 // block * block)
    bufs = [torch.ones(n, dtype=torch.bfloat16, device=dev) for _ in range(4)]
    out = torch.empty(n // block, device=dev)
    i = [0]

    def f():
        read[(n // block,)](bufs[i[0] % 4], out, BLOCK=block, num_warps=8)
        i[0] += 1
    return graph_time_us(lambda: [f() for _ in range(4)], reps=40) / 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--phase2", action="store_true")
    ap.add_argument("--options", action="store_true", help="phase 2 at T=1: also the path options and deep-K tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    moe, ref_moe, bf16, _ = build_layer(dev)
    print(f"weights {time.time() - t0:.1f}s wmode {moe.prepared.wmode1} {moe.prepared.wmode2}", flush=True)
    bw = stream_bandwidth(dev)["used"]
    print(f"bf16 streaming read bandwidth (4 GiB) {bw / 1e12:.3f} TB/s", flush=True)
    floors = {}
    for name, nb in (("g1_4experts", 4 * G1_BYTES), ("g2_4experts", 4 * G2_BYTES), ("layer_4experts", 4 * (G1_BYTES + G2_BYTES))):
        floors[name] = read_floor_us(dev, nb)
        print(f"plain read of {nb / 1e6:.1f} MB: {floors[name]:.1f} us = {nb / floors[name] / 1e6:.2f} TB/s", flush=True)
    expert_bytes = G1_BYTES + G2_BYTES
    if args.phase2:
        return phase2(args, dev, moe, bf16, ref_moe, bw, floors)
    results = {"bw": bw, "read_floor_us": floors, "rows": []}
    best_g1 = best_g2 = None  # the defaults until a T=1 sweep picks winners (with_g1/with_g2 take None)
    best_opts = {}
    for t in [int(v) for v in args.tokens.split(",")]:
        torch.manual_seed(t)
        x, ids, w = decode_problem(t, dev)
        ne = int(torch.unique(ids).numel())
        touched = ne * expert_bytes
        floor_us = touched / bw * 1e6
        ref = ref_moe.forward_topk(x, ids, w).float()
        base = tb.default_config(t, False)

        def run(cfg, opts, prepared=None):
            p = prepared or moe.prepared
            return lambda: tb.fused_moe(p, x, ids, w, RSF, cfg, **opts)

        def measure(name, cfg, opts, rows, twin=False):
            try:
                fn = run(cfg, opts)
                err = float((fn().float() - ref).norm() / ref.norm())
                kt = kernel_times(fn)
                us = graph_time_us(fn, reps=100 if t <= 16 else 40)
            except Exception as ex:  # report, keep going
                print(f"T={t} {name} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                return None
            g1, g2 = kt.get("gemm1", 0), kt.get("gemm2", 0)
            row = {"T": t, "name": name, "cfg": tb.fit_config(cfg, H, I).__dict__, "opts": opts, "us": us,
                   "x_floor": us / floor_us, "gemm1_us": g1, "gemm2_us": g2, "prep_us": kt.get("prep", 0),
                   "other_us": kt.get("other", 0), "gemm1_TBps": ne * G1_BYTES / g1 / 1e6 if g1 else 0,
                   "gemm2_TBps": ne * G2_BYTES / g2 / 1e6 if g2 else 0, "rel_err": err}
            if twin:
                row["us_bf16_twin"] = graph_time_us(run(cfg, {k: v for k, v in opts.items()}, bf16),
                                                    reps=100 if t <= 16 else 40)
                row["x_twin"] = row["us_bf16_twin"] / us
            rows.append(row)
            print(f"T={t:3d} {name:22s} {us:8.1f} us x{row['x_floor']:.3f} floor | g1 {g1:7.1f} us "
                  f"{row['gemm1_TBps']:.2f} TB/s | g2 {g2:7.1f} us {row['gemm2_TBps']:.2f} TB/s | prep "
                  f"{row['prep_us']:5.1f} other {row['other_us']:4.1f} | err {err:.1e}"
                  + (f" | bf16 twin {row['us_bf16_twin']:.1f} us x{row['x_twin']:.2f}" if twin else "")
                  + f" {opts} {tb.fit_config(cfg, H, I)}", flush=True)
            return row

        rows = []
        print(f"--- T={t}: {ne} experts, {touched / 1e6:.1f} MB, floor {floor_us:.1f} us", flush=True)
        if t == 1:  # the full sweep at one token; more tokens time its winners only
            g1v, g2v = g1_variants(), g2_variants()
            for (a, ga), (b, gb) in zip(g1v, g2v):  # GEMM1 variant k with GEMM2 variant k: both kernels profiled
                measure(f"{a}+{b}", with_g2(with_g1(base, ga), gb), {}, rows)
            ok = [r for r in rows if r["rel_err"] < 1e-2]
            best1 = min((r for r in ok if r["gemm1_us"]), key=lambda r: r["gemm1_us"])
            best2 = min((r for r in ok if r["gemm2_us"]), key=lambda r: r["gemm2_us"])
            c1, c2 = best1["cfg"], best2["cfg"]
            best_g1 = (c1["bn1"], c1["bk1"], c1["warps1"], c1["stages1"], c1["swap1"])
            best_g2 = (c2["bn2"], c2["bk2"], c2["warps2"], c2["stages2"], c2["swap2"])
            opt_rows = [r for r in ok if r["opts"]]
            best_opts = min(opt_rows, key=lambda r: r["us"])["opts"] if opt_rows else {}
            print(f"T={t} best GEMM1 {best1['name']} {best1['gemm1_us']:.1f} us, best GEMM2 {best2['name']} "
                  f"{best2['gemm2_us']:.1f} us, best opts {best_opts}", flush=True)
            results["t1_best"] = {"g1": best_g1, "g2": best_g2, "opts": best_opts}
        best_cfg = with_g2(with_g1(base, best_g1), best_g2)
        if t > 4:  # keep the sorted path's own pipeline depth
            best_cfg = replace(best_cfg, stages1=base.stages1, stages2=base.stages2)
        swap_cfg = replace(base, swap1=True, swap2=True)
        finals = [("default", base, {}), ("best_cfg", best_cfg, {})]
        if best_cfg != swap_cfg:
            finals.append(("swap", swap_cfg, {}))
        if best_opts and t <= 4:
            finals += [("best_cfg+opts", best_cfg, best_opts)]
        final_rows = {n: [] for n, _, _ in finals}
        for rnd in range(args.rounds):  # interleaved rounds: drift hits every variant alike
            for name, cfg, opts in (finals if rnd % 2 == 0 else finals[::-1]):
                r = measure(f"final_{name}_r{rnd}", cfg, opts, rows, twin=True)
                if r:
                    final_rows[name].append(r)
        for name, rs in final_rows.items():
            if rs:
                us = statistics.median(r["us"] for r in rs)
                tw = statistics.median(r["us_bf16_twin"] for r in rs)
                print(f"SUMMARY T={t} {name:14s} {us:8.1f} us x{us / floor_us:.3f} floor, bf16 twin {tw:8.1f} us "
                      f"x{tw / us:.2f}; g1 {statistics.median(r['gemm1_us'] for r in rs):.1f} g2 "
                      f"{statistics.median(r['gemm2_us'] for r in rs):.1f} prep "
                      f"{statistics.median(r['prep_us'] for r in rs):.1f}", flush=True)
        results["rows"] += rows
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_sweep_" + torch.cuda.get_device_name().replace(" ", "_") + ".json"),
                  "w") as f:
            json.dump(results, f, indent=1)


def routings(t, dev, n):
    """n routings of t tokens; at one token the n sets of experts are disjoint (no L2 reuse between layers)."""
    out = []
    for j in range(n):
        if t == 1:
            ids = (torch.arange(TOPK, device=dev) + TOPK * j)[torch.randperm(TOPK, device=dev)][None]
        else:
            ids = torch.rand(t, E, device=dev).topk(TOPK, dim=-1).indices
        w = torch.rand(t, TOPK, device=dev) + 0.1
        out.append((ids, w / w.sum(-1, keepdim=True)))
    return out


def phase2(args, dev, moe, bf16, ref_moe, bw, floors):
    import triton
    import triton.language as tl

    @triton.jit
    def one_store(p):
        tl.store(p, 1.0)

    z = torch.zeros(1, device=dev)
    noop = lambda: one_store[(1,)](z)
    print(f"one tiny kernel per graph: idle-GPU timing {graph_time_us(noop):.1f} us, queued {graph_time_queued_us(noop):.1f} us",
          flush=True)
    C = tb.MoeConfig
    out = {"bw": bw, "read_floor_us": floors, "rows": []}
    for t in [int(v) for v in args.tokens.split(",")]:
        torch.manual_seed(100 + t)
        x = torch.randn(t, H, device=dev).to(torch.bfloat16)
        rts = routings(t, dev, 8)
        ids, w = rts[0]
        ne = int(torch.unique(ids).numel())
        floor_us = ne * (G1_BYTES + G2_BYTES) / bw * 1e6
        ref = ref_moe.forward_topk(x, ids, w).float()
        base = tb.default_config(t, False)
        variants = [("default", base, {})]
        if t == 1 and args.options:
            variants += [("g1bk512w4+g2bk512w4", C(16, 32, 512, 4, 3, 64, 512, 4, 3), {}),
                         ("g1bk512w8+g2bk512w8", C(16, 32, 512, 8, 3, 64, 512, 8, 3), {}),
                         ("g1bk256w8s4+g2bk128s6", C(16, 32, 256, 8, 4, 64, 128, 4, 6), {}),
                         ("g1bk128s5+g2bk256s4", C(16, 32, 128, 4, 5, 64, 256, 4, 4), {})]
        # two warps, weights as the mma.sync left operand (swap): no dequant duplicated across warps and
        # ~19% fewer instructions per weight byte than the default in the SASS loop
        s3, s4 = base.stages1, base.stages1 + 1
        variants += [("sw32w2+sw64w2", C(16, 32, 256, 2, s3, 64, 256, 2, s3, True, True), {}),
                     ("sw16w2+sw32w2", C(16, 16, 256, 2, s3, 32, 256, 2, s3, True, True), {}),
                     ("g1w2+g2w2", C(16, 32, 256, 2, s3, 64, 256, 2, s3), {})]
        if t == 1:
            variants += [("sw32w2s4+sw64w2s4", C(16, 32, 256, 2, s4, 64, 256, 2, s4, True, True), {}),
                         ("sw16w2s4+sw32w2s4", C(16, 16, 256, 2, s4, 32, 256, 2, s4, True, True), {})]
        print(f"--- T={t}: {ne} experts, floor {floor_us:.1f} us", flush=True)
        for rnd in range(args.rounds):
            for name, cfg, opts in (variants if rnd % 2 == 0 else variants[::-1]):
                for tag, p in (("mxfp8", moe.prepared), ("bf16", bf16)):
                    if tag == "bf16" and name != "default":
                        continue
                    fns = [lambda ids=ids, w=w: tb.fused_moe(p, x, ids, w, RSF, cfg, **opts) for ids, w in rts]
                    try:
                        err = float((fns[0]().float() - ref).norm() / ref.norm())
                        kt = kernel_times(fns[0]) if tag == "mxfp8" else {}
                        idle = graph_time_us(fns[0], reps=60 if t <= 16 else 30)
                        queued = graph_time_queued_us(fns[0], reps=60 if t <= 16 else 30)
                        queued8 = graph_time_queued_us(None, reps=30 if t <= 16 else 10, calls=fns)
                    except Exception as ex:  # report, keep going
                        print(f"T={t} {name} {tag} FAILED {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                        continue
                    row = {"T": t, "round": rnd, "name": name, "weights": tag, "cfg": tb.fit_config(cfg, H, I).__dict__,
                           "opts": opts, "us_idle": idle, "us_queued": queued, "us_queued_8layers": queued8,
                           "floor_us": floor_us, "rel_err": err, **{k + "_us": v for k, v in kt.items()}}
                    out["rows"].append(row)
                    g1, g2 = kt.get("gemm1", 0), kt.get("gemm2", 0)
                    print(f"T={t:3d} r{rnd} {name:22s} {tag:5s} idle {idle:8.1f} queued {queued:8.1f} "
                          f"queued/8 layers {queued8:8.1f} us (x{queued8 / floor_us:.3f} floor) | g1 {g1:6.1f} "
                          f"({ne * G1_BYTES / g1 / 1e6 if g1 else 0:.2f} TB/s) g2 {g2:6.1f} "
                          f"({ne * G2_BYTES / g2 / 1e6 if g2 else 0:.2f} TB/s) prep {kt.get('prep', 0):4.1f} "
                          f"other {kt.get('other', 0):4.1f} | err {err:.1e}", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_timing_" + torch.cuda.get_device_name().replace(" ", "_") + ".json"),
                  "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
