"""Decode-size linears (a few rows against a big weight) as Triton kernels that stream the weight once:
`gemv` (MMA; MXFP8 or 16/32-bit weights, fused epilogues) and `gemv_stream` (one to four rows of a 16-bit
weight, no MMA; what one-row 16-bit linears run).

y [M, N] = x [M, K] @ W^T, W [N, K] bf16/fp16/fp32 as stored, or MXFP8 (float8_e4m3fn + one uint8 UE8M0
byte per 32 along K, the rule of porter/format/mxfp8.py; dequantized per tile in registers, see
runtime/kernels/gemv_triton.py). At decode a layer is bound by its weight bytes: MXFP8 weights must be read as
stored (1 byte + 1/32 scale byte per weight) rather than dequantized to bf16 per call, and the epilogues
fold in what the unfused layer does next with the output, bit for bit in its rounding:
  * `swiglu=(alpha, beta, limit)`: W = [gate; up] rows, y = SwiGLU-OAI(gate, up) (shared expert, dense MLP);
  * `add=(a1,)` / `add=(a1, a2)`: y = (y + a1) + a2 in the output dtype (residual adds).
Tile configs: the largest tiles that fit in shared memory streamed best on the H200 (config; measurements:
docs/runtime-decode.md); gemv's cfg=(BN, BK, WARPS, STAGES) overrides them (benchmarks). 16-bit weights
run `gemv_stream` at one row and cuBLAS at more rows, not `gemv`: cuBLAS streams a plain bf16 GEMV faster
(`runs`, `streams`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from runtime.kernels.fused import next_pow2, pdl, use_triton

MAX_ROWS = 64  # the kernel pads rows to BM <= 64; beyond that a GEMM is no longer bound by weight bytes
SMEM_BYTES = 216 * 1024  # per program: (stages - 1) pipeline buffers (+ the e4m3 path's MMA operand copies)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv runs x against weight: CUDA + triton, few rows, float weights or MXFP8 e4m3."""
    return (
        use_triton(x)
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
        and use_triton(weight)
        and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
    )


def runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear of x against weight runs gemv: MXFP8 weights, whenever gemv applies. 16-bit weights
    stream faster through gemv_stream (one row) or cuBLAS."""
    return weight.dtype == torch.float8_e4m3fn and applies(x, weight)


def streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a 16-bit linear of x runs gemv_stream: one row (batch-1 decode), a bf16/fp16 weight of x's
    dtype (at more rows cuBLAS is faster)."""
    return (
        applies(x, weight)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and x.numel() == x.shape[-1]
    )


def config(swiglu: bool, mx: bool) -> tuple[int, int, int, int]:
    """(BN, BK, warps, stages): the H200 sweep's best at MiniMax-M3's decode shapes (rows 1 and 8)."""
    if swiglu and not mx:
        return 32, 256, 4, 3  # 64 weight rows x 256 (bf16: 32 KB per step)
    return 32, 512, 4, 4


def fit(bm: int, rows: int, bk: int, stages: int, x_bytes: int, w_bytes: int, mx: bool) -> tuple[int, int]:
    """(BK, stages) whose pipeline buffers fit SMEM_BYTES: fewer stages first (down to 2), then a
    narrower K step (many rows or fp32 activations)."""

    def need(bk_, st):
        pipeline = (st - 1) * (bk_ * (bm * x_bytes + rows * w_bytes) + (rows * bk_ // 32 if mx else 0))
        # e4m3: Triton stages the x tile and the dequantized weight tile once more as MMA operands
        operands = bk_ * (bm * x_bytes + rows * (4 if x_bytes == 4 else 2)) if mx else 0
        return pipeline + operands

    while need(bk, stages) > SMEM_BYTES and stages > 2:
        stages -= 1
    while need(bk, stages) > SMEM_BYTES and bk > 64:
        bk //= 2
    return bk, stages


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: Optional[torch.Tensor] = None,
    *,
    swiglu: Optional[tuple] = None,
    add: Sequence[torch.Tensor] = (),
    cfg: Optional[tuple] = None,
) -> torch.Tensor:
    """x [..., K], weight [Nw, K] (+ scale [Nw, K/32] uint8 for e4m3) -> [..., N] (N = Nw, or Nw/2 with
    swiglu) in x's dtype. add: up to two [..., N] tensors added in order."""
    from runtime.kernels.gemv_triton import gemv_kernel

    K = x.shape[-1]
    nw = weight.shape[0]
    n = nw // 2 if swiglu is not None else nw
    if weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(
            f"gemv: weight {tuple(weight.shape)} (stride {weight.stride()}) does not take x [..., {K}]"
        )
    if len(add) > 2:
        raise ValueError(f"gemv: at most two add tensors, got {len(add)}")  # the epilogue has two slots
    mx = weight.dtype == torch.float8_e4m3fn
    if mx and (scale is None or K % 32):
        raise ValueError("gemv: an e4m3 weight needs its uint8 scales and K % 32 == 0")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    dt = x.dtype
    y = torch.empty((M, n), dtype=dt, device=x.device)
    adds = [a.reshape(M, n) for a in add]
    for a in adds:
        if a.stride(-1) != 1:
            raise ValueError("gemv: add tensors need a contiguous last dim")
    per = 2 if swiglu is not None else 1
    bn, bk, warps, stages = cfg or config(swiglu is not None, mx)
    ieee = torch.float32 in (x.dtype, weight.dtype)
    bk = min(
        bk, max(32 if mx else 16, next_pow2(K)), 128 if ieee else bk
    )  # fp32: a reference path, not tuned
    bm = max(16, next_pow2(M))
    # fp32 MMA: a 16-bit weight tile is staged in shared memory already widened to fp32; an e4m3 tile is
    # staged as bytes and dequantized in registers
    w_bytes = 4 if ieee and not mx else weight.element_size()
    bk, stages = fit(bm, bn * per, bk, stages, 4 if ieee else x2.element_size(), w_bytes, mx)
    alpha, beta, limit = (float(v) for v in swiglu) if swiglu is not None else (0.0, 0.0, 0.0)
    a1 = adds[0] if adds else y
    a2 = adds[1] if len(adds) > 1 else y
    s = scale if mx else weight
    grid = (-(-n // bn), -(-M // bm))
    gemv_kernel[grid](
        x2,
        weight,
        s,
        y,
        a1,
        a2,
        M,
        n,
        K,
        x2.stride(0),
        weight.stride(0),
        s.stride(0),
        y.stride(0),
        a1.stride(0),
        a2.stride(0),
        alpha,
        beta,
        limit,
        BM=bm,
        BN=bn,
        BK=bk,
        ROWS=bn * per,
        MX=mx,
        IEEE=ieee,
        EVEN_K=K % bk == 0,
        SWIGLU=swiglu is not None,
        ADDS=len(adds),
        num_warps=warps,
        num_stages=stages,
        **pdl(x.device),
    )
    return y.reshape(*x.shape[:-1], n)


STREAM_ROWS = 4  # gemv_stream: x rows it takes (its [rows, BN, BK] fp32 partial products live in registers)
STREAM_CONFIG = (4, 1024, 4)  # gemv_stream's (BN, BK, warps): the best single config over the decode linears


def gemv_stream(x: torch.Tensor, weight: torch.Tensor, cfg: Optional[tuple] = None) -> torch.Tensor:
    """x [..., K] (at most STREAM_ROWS rows), weight [N, K] bf16/fp16 of x's dtype -> x @ weight^T [..., N]
    in x's dtype, by gemv_stream_kernel (no MMA; cfg = (BN, BK, warps)). With PDL the kernel reads the weight
    before waiting for the previous kernel: the weight must not be written by the kernel launched just before
    (model weights never are)."""
    from runtime.kernels.gemv_triton import gemv_stream_kernel

    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > STREAM_ROWS or weight.dtype != x.dtype or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(
            f"gemv_stream: x {tuple(x.shape)} {x.dtype} against weight {tuple(weight.shape)} "
            f"{weight.dtype} (at most {STREAM_ROWS} rows, same dtype, contiguous K)"
        )
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bn, bk, warps = cfg or STREAM_CONFIG
    bk = min(bk, next_pow2(K))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    gemv_stream_kernel[(-(-N // bn),)](
        x2,
        weight,
        y,
        M,
        N,
        K,
        x2.stride(0),
        weight.stride(0),
        y.stride(0),
        MP=next_pow2(M),
        BN=bn,
        BK=bk,
        EVEN_K=K % bk == 0,
        num_warps=warps,
        **pdl(x.device),
    )
    return y.reshape(*x.shape[:-1], N)
