"""A/B of the decode linears' 16-bit GEMV at MiniMax-M3's shapes: cuBLAS (torch.nn.functional.linear),
runtime.kernels.gemv's MMA kernel and runtime.kernels.gemv.gemv_stream (register-streaming, no MMA), rows 1/2/4.

Each timed graph cycles through enough copies of the weight (>= 400 MB) that no call finds its weight
in L2 (50 MB on the H200), as a decode step that streams 60 layers never does. Prints µs, TB/s of weight
bytes and the ratio to cuBLAS per (shape, rows, config); checks every result against an fp32 matmul.

    python benchmarks/gemv_stream_ab.py --out benchmarks/results/gemv_stream_ab_NVIDIA_H200.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gemv_sweep  # noqa: E402
from benchmarks.decode import copy_bandwidth  # noqa: E402
from benchmarks.gemv_sweep import graph_ms  # noqa: E402
from runtime.kernels import gemv  # noqa: E402

SHAPES = {name: (n, k) for name, (n, k, _) in gemv_sweep.SHAPES.items()}  # (N, K) of each decode linear
STREAM_CONFIGS = [(8, 512, 4), (4, 1024, 4), (16, 256, 4), (8, 1024, 8), (16, 512, 8), (4, 512, 2), (2, 1024, 2)]


def rotating_ms(fn, copies: int) -> float:
    """µs per call of fn(i), i cycling over 0..copies-1, in one CUDA graph of `copies` calls (gemv_sweep's
    timer)."""
    it = itertools.cycle(range(copies))
    return graph_ms(lambda: fn(next(it)), reps=copies) * 1e3


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    copy = copy_bandwidth() / 1e12
    print(f"copy bandwidth (read + write bytes) {copy:.2f} TB/s", flush=True)
    results = {"copy_TBps": copy, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, -(-400_000_000 // nbytes))
        ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16() for _ in range(copies)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ ws[0].float().t()
            runs = {"cublas": lambda i: torch.nn.functional.linear(x, ws[i]),
                    "gemv_mma": lambda i: gemv.gemv(x, ws[i])}
            for cfg in STREAM_CONFIGS:
                runs[f"stream{cfg}"] = lambda i, c=cfg: gemv.gemv_stream(x, ws[i], cfg=c)
            base = None
            for label, fn in runs.items():
                try:
                    err = float((fn(0).float() - want).norm() / want.norm())
                    us = rotating_ms(fn, copies)
                except Exception as e:  # a config that does not compile: report and go on
                    print(f"{name} rows={rows} {label}: failed ({str(e).splitlines()[0][:100]})", flush=True)
                    continue
                base = base or us
                tbps = nbytes / us / 1e6
                row = {"shape": name, "N": n, "K": k, "rows": rows, "kernel": label, "us": us, "TBps": tbps,
                       "x_cublas": us / base, "rel_err": err}
                results["rows"].append(row)
                print(f"{name:15s} rows={rows} {label:22s} {us:7.1f} us {tbps:5.2f} TB/s  x cuBLAS {us / base:5.3f}"
                      f"  rel {err:.1e}", flush=True)
                assert err <= 1e-2, (name, rows, label, err)
        del ws
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
