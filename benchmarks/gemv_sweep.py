"""Tile sweep of runtime.gemv at MiniMax-M3's decode shapes, against torch's matmul.

For each linear a decode step runs (stacked q/k/v/index projection, o_proj, shared expert [gate; up] with
the SwiGLU epilogue and down, dense MLP [gate; up] and down, the fp32 router), rows 1/8/32, weights bf16
and MXFP8: ms per call (CUDA-graph replay of 20 calls), TB/s of weight bytes, and the same for
torch.nn.functional.linear (bf16; MXFP8: the dequantized bf16 weight, i.e. what cuBLAS would stream).
Prints one line per (shape, config) and the best config per shape; writes JSON to --out.

    python benchmarks/gemv_sweep.py --out benchmarks/results/gemv_sweep_NVIDIA_H200.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import gemv  # noqa: E402

H, I_EXPERT, I_DENSE, NQ, NKV, D, NI, DI = 6144, 3072, 12288, 64, 4, 128, 4, 128
# name: (weight rows, K, swiglu)
SHAPES = {
    "qkv_index": (NQ * D + 2 * NKV * D + NI * DI + DI, H, False),
    "o_proj": (H, NQ * D, False),
    "shared_gate_up": (2 * I_EXPERT, H, True),
    "shared_down": (H, I_EXPERT, False),
    "dense_gate_up": (2 * I_DENSE, H, True),
    "dense_down": (H, I_DENSE, False),
}
# (BN, BK, warps, stages); rows 1 and 8 share one compile per config (BM 16), rows 32 runs the best 3
CONFIGS = [(16, 256, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 3), (32, 512, 4, 4), (16, 128, 4, 5),
           (8, 512, 4, 4), (8, 256, 4, 4)]


def graph_ms(fn, reps: int = 20, iters: int = 5) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (iters * reps)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    from porter.format import mxfp8
    dev = "cuda"
    results = []
    for name in args.shapes.split(","):
        nw, k, swiglu = SHAPES[name]
        w = torch.randn(nw, k, device=dev) / k ** 0.5
        q, s = mxfp8.quantize(w)
        wb = w.bfloat16()
        del w
        per = 2 if swiglu else 1
        sw = (1.702, 1.0, 7.0) if swiglu else None
        for kind, weight, scale in (("bf16", wb, None), ("mxfp8", q, s)):
            nbytes = weight.numel() * weight.element_size() + (scale.numel() if scale is not None else 0)
            best_cfgs = None
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
                ref = graph_ms(lambda: torch.nn.functional.linear(x, wb))
                default = gemv.config(swiglu, scale is not None)
                cfgs = CONFIGS if rows <= 16 or best_cfgs is None else best_cfgs
                timings = []
                for cfg in cfgs:
                    if cfg[0] * per < 16:
                        continue
                    try:
                        ms = graph_ms(lambda: gemv.gemv(x, weight, scale, swiglu=sw, cfg=cfg))
                    except Exception as e:  # out of shared memory etc.: report and go on
                        print(f"{name} {kind} rows={rows} cfg={cfg}: failed ({str(e).splitlines()[0][:80]})")
                        continue
                    timings.append((ms, cfg))
                timings.sort()
                if rows <= 16:
                    best_cfgs = [c for _, c in timings[:3]]
                dms = graph_ms(lambda: gemv.gemv(x, weight, scale, swiglu=sw))
                for ms, cfg in timings[:8]:
                    print(f"{name:15s} {kind:5s} rows={rows:2d} cfg={cfg}: {ms * 1e3:7.1f} us "
                          f"{nbytes / ms / 1e9:5.2f} TB/s")
                ms, cfg = timings[0]
                line = {"shape": name, "weight": kind, "rows": rows, "N": nw, "K": k, "bytes": nbytes,
                        "best_cfg": cfg, "best_us": ms * 1e3, "best_TBps": nbytes / ms / 1e9,
                        "default_cfg": default, "default_us": dms * 1e3, "default_TBps": nbytes / dms / 1e9,
                        "torch_bf16_us": ref * 1e3, "torch_bf16_TBps": wb.numel() * 2 / ref / 1e9}
                results.append(line)
                print(f"BEST {name} {kind} rows={rows}: {cfg} {ms * 1e3:.1f} us ({line['best_TBps']:.2f} TB/s); "
                      f"default {default} {dms * 1e3:.1f} us ({line['default_TBps']:.2f} TB/s); torch bf16 "
                      f"{ref * 1e3:.1f} us ({line['torch_bf16_TBps']:.2f} TB/s)", flush=True)
    # the router: fp32 weights [E, H] -> fp32 logits (runtime.fused.router_logits: one program per expert)
    from runtime import fused
    for e in (8, 128):
        rw = torch.randn(e, H, device=dev)
        x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
        ms = graph_ms(lambda: fused.router_logits(x, rw))
        ref = graph_ms(lambda: x.float() @ rw.t())
        print(f"router E={e}: router_logits {ms * 1e3:.1f} us, torch {ref * 1e3:.1f} us")
        results.append({"shape": f"router_E{e}", "router_logits_us": ms * 1e3, "torch_us": ref * 1e3})
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "results": results}, indent=1))


if __name__ == "__main__":
    main()
