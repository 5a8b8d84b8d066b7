"""Dequantizing GEMM for MXFP8 linears (`porter convert --quantize all`) at decode sizes.

y [M, N] = x [M, K] @ deq(W)^T with W [N, K] float8_e4m3fn and one uint8 UE8M0 byte per 32 along K
(value = e4m3 * 2^(byte - 127), the rule of porter/mxfp8.py). Each program streams a [BN, K] slab of the
1-byte weights once, dequantizes each [BN, BK] tile in registers to x's dtype (computed in fp32, so the
tile equals porter.mxfp8.dequantize(..., x.dtype)) and multiplies it on the tensor cores with fp32
accumulation. Used for few rows (decode), where the layer is bound by the weight bytes; for many rows
the runtime dequantizes once per call and runs one big matmul.
"""
from __future__ import annotations

import torch

from runtime.fused import use_triton

MAX_ROWS = 64  # above this dequantize-then-matmul wins (the matmul is no longer bound by weight bytes)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (use_triton(x) and weight.dtype == torch.float8_e4m3fn
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and x.numel() // x.shape[-1] <= MAX_ROWS and weight.shape[1] % 128 == 0)


def mxfp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] e4m3, scale [N, K/32] uint8 -> [..., N] in x's dtype."""
    from runtime.mxfp8_linear_triton import mxfp8_linear_kernel
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K).contiguous()  # [M, K]
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    bm, bn, bk = 16, 32, 128
    grid = (-(-N // bn), -(-M // bm))
    mxfp8_linear_kernel[grid](x2, weight, scale, y, M, N, K, x2.stride(0), weight.stride(0), scale.stride(0),
                              y.stride(0), BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32,
                              num_warps=4, num_stages=4)
    return y.reshape(*x.shape[:-1], N)
