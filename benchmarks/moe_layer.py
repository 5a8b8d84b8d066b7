"""One MiniMax-M3 routed-MoE layer on one GPU: the Triton MXFP8 backend against its own bf16-weight
twin (same kernels, weights dequantized to bf16 once) and the torch reference backend.

Per token count T: time (CUDA-graph replay median; eager median too), the weight + scale bytes the
layer touches (distinct routed experts x expert bytes), TB/s, the ratio to the bytes floor (touched
bytes / bf16 streaming read bandwidth measured in this run), speed-ups over bf16 weights and torch.
Writes moe_layer_<gpu>.json and .md into --out (default benchmarks/results/).

  python3 benchmarks/moe_layer.py [--out DIR] [--tokens 1,4,...] [--sweep]

--sweep also times a few alternative tile configs per T and reports the best (tuning aid).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from porter import mxfp8  # noqa: E402
from runtime.moe import triton_backend as tb  # noqa: E402
from runtime.moe.contract import MoeQuantInfo, MoeRouting, make_swiglu_params  # noqa: E402
from runtime.moe.torch_backend import TorchMoE  # noqa: E402

E, H, I, TOPK = 128, 6144, 3072, 4
ALPHA, BETA, LIMIT, RSF = 1.702, 1.0, 7.0, 2.5
GOALS = "T=1 <= 1.15x floor; T=16..64 <= 1.08x floor; >= 1.8x bf16 for T=1..64; T=4096 >= 1.0x bf16"


def build_weights(dev):
    """Random MXFP8 experts through porter.mxfp8 (rceil), plus their exact bf16 dequantization."""
    q13 = torch.empty((E, 2 * I, H), dtype=torch.float8_e4m3fn, device=dev)  # [E, 2I, H]
    s13 = torch.empty((E, 2 * I, H // 32), dtype=torch.uint8, device=dev)
    q2 = torch.empty((E, H, I), dtype=torch.float8_e4m3fn, device=dev)  # [E, H, I]
    s2 = torch.empty((E, H, I // 32), dtype=torch.uint8, device=dev)
    b13 = torch.empty((E, 2 * I, H), dtype=torch.bfloat16, device=dev)
    b2 = torch.empty((E, H, I), dtype=torch.bfloat16, device=dev)
    for e in range(E):
        # sigma 0.02 with per-row gains of +-2 octaves so scale bytes vary like real checkpoints
        w = torch.randn(2 * I, H, device=dev) * 0.02 * torch.exp2(torch.randint(-2, 3, (2 * I, 1), device=dev).float())
        q13[e], s13[e] = mxfp8.quantize(w)
        b13[e] = mxfp8.dequantize(q13[e], s13[e], torch.bfloat16)
        w = torch.randn(H, I, device=dev) * 0.02
        q2[e], s2[e] = mxfp8.quantize(w)
        b2[e] = mxfp8.dequantize(q2[e], s2[e], torch.bfloat16)
    return (q13, s13, q2, s2), (b13, b2)


def stream_bandwidth(dev) -> dict:
    """bf16 streaming read bandwidth (bytes/s): best of a Triton read-reduce kernel and torch.sum."""
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        x = tl.load(x_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
        tl.store(out_ptr + pid, tl.sum(x.to(tl.float32), axis=0))

    n = 2 * 1024 ** 3  # 4 GiB of bf16, far past L2
    buf = torch.randn(n // 1024, device=dev).to(torch.bfloat16).repeat(1024)
    res = {}
    for block in (4096, 16384):
        out = torch.empty(n // block, device=dev)
        ms = triton.testing.do_bench(lambda: read_kernel[(n // block,)](buf, out, BLOCK=block, num_warps=8),
                                     warmup=50, rep=300, return_mode="median")
        res[f"triton_read_b{block}"] = 2 * n / (ms * 1e-3)
    ms = triton.testing.do_bench(lambda: buf.sum(dtype=torch.float32), warmup=50, rep=300, return_mode="median")
    res["torch_sum"] = 2 * n / (ms * 1e-3)
    dst = torch.empty_like(buf)
    ms = triton.testing.do_bench(lambda: dst.copy_(buf), warmup=50, rep=300, return_mode="median")
    res["torch_copy_read_plus_write"] = 4 * n / (ms * 1e-3)
    del buf, dst
    torch.cuda.empty_cache()
    res["used"] = max(v for k, v in res.items() if k != "torch_copy_read_plus_write")
    return res


def graph_time_us(fn, reps=60) -> float:
    """Median of per-replay event timings of a CUDA graph of fn (launch gaps between the kernels
    of one call are included; CPU launch cost is not)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def eager_time_us(fn, reps=30) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=20, rep=max(50, reps), return_mode="median") * 1e3


def torch_time_us(fn, reps) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def sweep_candidates(t: int) -> list[tb.MoeConfig]:
    """A few alternatives to default_config (decode configs were chosen by benchmarks/moe_ab_h200.py)."""
    C = tb.MoeConfig
    if t <= 256:
        return []
    if t <= 1024:
        return [C(16, 32, 256, 1, 4, 3, 64, 256, 1, 4, 3, True), C(64, 64, 128, 1, 8, 3, 128, 64, 1, 4, 4),
                C(32, 32, 256, 1, 4, 4, 64, 256, 1, 4, 4, True)]
    return [C(64, 64, 128, 1, 8, 3, 128, 64, 1, 4, 4), C(128, 64, 128, 1, 8, 3, 128, 64, 1, 4, 4),
            C(128, 128, 64, 1, 8, 3, 128, 128, 1, 8, 3)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--torch-reps", type=int, default=3)
    ap.add_argument("--profile", default="", help="comma list of T: per-kernel CUDA times (torch.profiler)")
    args = ap.parse_args()
    import triton
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    meta = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "shape": {"E": E, "H": H, "I": I, "top_k": TOPK}, "goals": GOALS}
    print(f"GPU {props.name} ({props.multi_processor_count} SMs) torch {torch.__version__} "
          f"triton {triton.__version__}", flush=True)
    bw = stream_bandwidth(dev)
    meta["stream_bandwidth_Bps"] = bw
    print("bandwidth (TB/s): " + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in bw.items()), flush=True)
    t0 = time.time()
    (q13, s13, q2, s2), (b13, b2) = build_weights(dev)
    print(f"weights built in {time.time() - t0:.1f} s", flush=True)
    sw = make_swiglu_params(E, ALPHA, BETA, LIMIT, dev)
    quant = MoeQuantInfo(q13, s13, q2, s2, **sw)
    routing = MoeRouting(torch.randn(E, H, device=dev) * 0.02, torch.zeros(E, device=dev), TOPK, RSF)
    moe = tb.TritonMoE(quant, routing)
    ref_moe = TorchMoE(quant, routing)
    bf16 = tb.prepare(b13, None, b2, None, sw["gemm1_alpha"], sw["gemm1_beta"], sw["gemm1_clamp_limit"])
    meta["fp16_guards"] = {"gemm1_fp16": moe.prepared.fp16_1, "gemm2_fp16": moe.prepared.fp16_2,
                           "w13_shift_range": [int(moe.prepared.shift13.min()), int(moe.prepared.shift13.max())]}
    expert_bytes = 2 * I * H + 2 * I * H // 32 + H * I + H * I // 32
    expert_bytes_bf16 = (2 * I * H + H * I) * 2
    for t in [int(v) for v in args.profile.split(",") if v]:
        profile_kernels(moe, bf16, t, dev)
    rows = []
    for t in [int(v) for v in args.tokens.split(",") if v]:
        x = torch.randn(t, H, device=dev).to(torch.bfloat16)
        ids = torch.rand(t, E, device=dev).topk(TOPK, dim=-1).indices  # uniform distinct experts
        w = torch.rand(t, TOPK, device=dev) + 0.1
        w = w / w.sum(-1, keepdim=True)
        distinct = int(torch.unique(ids).numel())
        touched = distinct * expert_bytes
        cfg = tb.default_config(t)
        fn = lambda: moe.forward_topk(x, ids, w, cfg)
        out = fn()
        ref = ref_moe.forward_topk(x, ids, w)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        us = graph_time_us(fn)
        us_eager = eager_time_us(fn)
        us_bf16 = graph_time_us(lambda: tb.fused_moe(bf16, x, ids, w, RSF, cfg))
        us_torch = torch_time_us(lambda: ref_moe.forward_topk(x, ids, w), args.torch_reps)
        floor_us = touched / bw["used"] * 1e6
        row = {"T": t, "distinct_experts": distinct, "touched_bytes": touched, "us": us, "us_eager": us_eager,
               "TBps": touched / us / 1e6, "floor_us": floor_us, "ratio_to_floor": us / floor_us,
               "us_bf16": us_bf16, "bf16_TBps": distinct * expert_bytes_bf16 / us_bf16 / 1e6,
               "speedup_vs_bf16": us_bf16 / us, "us_torch": us_torch, "speedup_vs_torch": us_torch / us,
               "rel_err_vs_torch": err, "config": cfg.__dict__}
        if args.sweep:
            best = (us, cfg)
            for cand in sweep_candidates(t):
                try:
                    c_us = graph_time_us(lambda: moe.forward_topk(x, ids, w, cand), reps=30)
                except Exception as ex:  # a config that fails to compile is reported, not fatal
                    print(f"  T={t} {cand} FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)
                    continue
                print(f"  sweep T={t} {tb.fit_config(cand, H, I)} {c_us:.1f} us", flush=True)
                if c_us < best[0]:
                    best = (c_us, cand)
            row["sweep_best_us"], row["sweep_best_config"] = best[0], best[1].__dict__
        rows.append(row)
        print(f"T={t:5d} experts={distinct:3d} {us:9.1f} us (eager {us_eager:9.1f}) {row['TBps']:.2f} TB/s "
              f"floor x{row['ratio_to_floor']:.3f} bf16 {us_bf16:9.1f} us (x{row['speedup_vs_bf16']:.2f}) "
              f"torch {us_torch:10.1f} us (x{row['speedup_vs_torch']:.1f}) rel_err {err:.2e}", flush=True)
    if rows:
        write_results(args.out, meta, rows)


def profile_kernels(moe, bf16, t, dev):
    """Per-kernel device time of prep / GEMM1 / GEMM2 / cast, MXFP8 and bf16 weights (diagnosis)."""
    from torch.profiler import ProfilerActivity, profile
    x = torch.randn(t, H, device=dev).to(torch.bfloat16)
    ids = torch.rand(t, E, device=dev).topk(TOPK, dim=-1).indices
    w = torch.full((t, TOPK), 1.0 / TOPK, device=dev)
    for name, fn in (("mxfp8", lambda: moe.forward_topk(x, ids, w)),
                     ("bf16", lambda: tb.fused_moe(bf16, x, ids, w, RSF))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"--- profile T={t} {name} (10 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))


def write_results(out_dir, meta, rows):
    os.makedirs(out_dir, exist_ok=True)
    tag = meta["gpu"].replace(" ", "_")
    with open(os.path.join(out_dir, f"moe_layer_{tag}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    bw = meta["stream_bandwidth_Bps"]["used"] / 1e12
    lines = [f"# MoE layer benchmark: MiniMax-M3 dims (E={E}, H={H}, I={I}, top-{TOPK}), MXFP8 Triton backend",
             "", f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}. "
             f"bf16 streaming read bandwidth (floor rate) {bw:.3f} TB/s. Times: CUDA-graph replay median.",
             f"Goals: {GOALS}.", "",
             "| T | experts | touched MB | µs | µs eager | TB/s | × floor | bf16 µs | × vs bf16 | torch µs | × vs torch | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['T']} | {r['distinct_experts']} | {r['touched_bytes'] / 1e6:.1f} | {r['us']:.1f} | "
                     f"{r['us_eager']:.1f} | {r['TBps']:.2f} | {r['ratio_to_floor']:.3f} | {r['us_bf16']:.1f} | "
                     f"{r['speedup_vs_bf16']:.2f} | {r['us_torch']:.0f} | {r['speedup_vs_torch']:.1f} | "
                     f"{r['rel_err_vs_torch']:.1e} |")
    with open(os.path.join(out_dir, f"moe_layer_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
