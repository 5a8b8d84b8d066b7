"""What bounds the FP8 prefill path of the MiniMax-M3 MoE layer at a given T: the MMA work it must do and
how fast this GPU does that work in the best case (cuBLAS, one dense GEMM of the same total shape).

The FP8 path multiplies every routed row twice per weight (two e4m3 activation terms: one term alone puts
the layer's rel error at 4.8e-2, over the 2e-2 bound, docs/moe-backends.md), and computes whole BM blocks
(each expert's rows padded to BM). Printed per T and BM: routed rows, computed rows (padding), the MMA
FLOPs of GEMM1 + GEMM2, the datasheet fp8 floor of that work, and torch._scaled_mm's time for the same
products as two dense GEMMs ([terms * rows, H] x [H, 2I] and [terms * rows, I] x [I, H], e4m3 -> bf16):
no gathers, no padding, no SwiGLU, no scales, so a layer cannot beat it on this GPU with this scheme.

  python3 benchmarks/moe_prefill_floor.py [--tokens 1024,4096] [--bm 32,64,128] [--terms 1,2]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import E, FP8_DENSE_FLOPS, H, I, TOPK, decode_problem, scaled_mm_us  # noqa: E402
from runtime.moe import triton_backend as tb  # noqa: E402


def computed_rows(ids: torch.Tensor, bm: int) -> int:
    """Rows the sorted path multiplies: the BM blocks triton_backend.align_tokens fills (each expert's routed
    rows rounded up to BM)."""
    _, expert_ids = tb.align_tokens(ids, E, bm)
    return int((expert_ids < E).sum()) * bm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--bm", default="32,64,128")
    ap.add_argument("--terms", default="1,2")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; E={E} H={H} I={I} top-{TOPK}; "
          f"datasheet fp8 {FP8_DENSE_FLOPS / 1e12:.0f} TFLOP/s", flush=True)
    for t in [int(v) for v in args.tokens.split(",")]:
        _, ids, _ = decode_problem(t, dev)
        routed = t * TOPK
        for bm in [int(v) for v in args.bm.split(",")]:
            rows = computed_rows(ids, bm)
            print(f"T={t} BM={bm}: routed rows {routed}, computed {rows} (+{rows / routed - 1:.1%} padding; "
                  f"grid blocks {tb.max_blocks(routed, E, bm)} worst case)", flush=True)
        for terms in [int(v) for v in args.terms.split(",")]:
            m = terms * routed
            flops = 2 * m * (H * 2 * I + I * H)
            g1 = scaled_mm_us(m, H, 2 * I, dev)
            g2 = scaled_mm_us(m, I, H, dev)
            print(f"T={t} terms={terms}: {flops / 1e12:.2f} TFLOP unpadded, datasheet floor "
                  f"{flops / FP8_DENSE_FLOPS * 1e6:.0f} us; torch._scaled_mm dense GEMM1 {g1:.0f} us + GEMM2 "
                  f"{g2:.0f} us = {g1 + g2:.0f} us ({flops / ((g1 + g2) * 1e-6) / 1e12:.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
