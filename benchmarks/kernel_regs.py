"""Registers, spills and shared memory per compiled MoE kernel (what the driver reports after loading) for the
MoeConfig field lists given, one token at MiniMax-M3 dims with 8 experts (occupancy: 65536 registers and 227 KB
of shared memory per SM on the H200):
  python3 benchmarks/kernel_regs.py --configs "16,32,256,4,3,64,256,4,3;..." """
from __future__ import annotations

import argparse
import ast
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import RSF, TOPK, decode_problem, prepare_quant, random_quant  # noqa: E402
from runtime.moe import triton_backend as tb, triton_kernels as K  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="16,32,256,4,3,64,256,4,3")
    args = ap.parse_args()
    dev = torch.device("cuda")
    e = 8
    p = prepare_quant(random_quant(dev, e))
    x, _, w = decode_problem(1, dev)
    ids = torch.randperm(e, device=dev)[:TOPK][None]  # [1, TOPK] distinct experts of the e
    for c in [tb.MoeConfig(*ast.literal_eval(f"({c},)")) for c in args.configs.split(";") if c]:
        tb.fused_moe(p, x, ids, w, RSF, c)
    torch.cuda.synchronize()
    for fn in (K.prep_kernel, K.gemm1_swiglu_kernel, K.gemm2_reduce_kernel):
        for cache in fn.device_caches.values():
            for key, k in cache[0].items():
                print(f"{fn.__name__}: regs {k.n_regs} spills {k.n_spills} warps {k.metadata.num_warps} "
                      f"stages {k.metadata.num_stages} shared {k.metadata.shared} | {str(key)[-160:]}", flush=True)


if __name__ == "__main__":
    main()
