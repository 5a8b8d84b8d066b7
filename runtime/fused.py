"""Fused elementwise steps of the decoder layer: Gemma RMSNorm, per-head norm + RoPE, SwiGLU-OAI.

On CUDA each runs as one Triton kernel (runtime/fused_triton.py); elsewhere `use_triton` is False and
runtime/models/minimax_m3.py runs its torch reference. Same math: fp32 inside, the normed value rounded
to the compute dtype before RoPE as the reference does; the fused RoPE and SwiGLU round once at the end
where the reference rounds after every op (differences of an ulp of the compute dtype; none in fp32).
"""
from __future__ import annotations

import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=None)
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether x's op runs a Triton kernel (CUDA tensor, triton installed; checked once per process):
    the one test of the fused steps, runtime.attention's decode kernel and runtime.mxfp8_linear."""
    return x.is_cuda and _have_triton()


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): Triton block extents."""
    return 1 << (max(n, 1) - 1).bit_length()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], w [N] (Gemma delta: scales by 1 + w) -> [..., N] in x's dtype."""
    from runtime.fused_triton import rms_norm_kernel
    n = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    rms_norm_kernel[(xc.numel() // n,)](xc, w, y, n, eps, BLOCK=next_pow2(n), num_warps=8 if n >= 4096 else 4)
    return y


def norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, n, d], w [d], cos/sin [B, T, r] in x's dtype -> RoPE(rms_norm(x)) [B, T, n, d]."""
    from runtime.fused_triton import norm_rope_kernel
    B, T, n, d = x.shape
    r = cos.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    norm_rope_kernel[(B * T * n,)](xc, w, cos.contiguous(), sin.contiguous(), y, n, d, r, eps,
                                   BLOCK=next_pow2(d), num_warps=1 if d <= 128 else 4)
    return y


def swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, beta: float, limit: float) -> torch.Tensor:
    """gate/up [M, I] (row strides may differ from I: e.g. halves of one [M, 2I] GEMM) -> [M, I]."""
    from runtime.fused_triton import swiglu_kernel
    inter = gate.shape[-1]
    g2, u2 = gate.reshape(-1, inter), up.reshape(-1, inter)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    n = y.numel()
    block = 1024
    swiglu_kernel[(-(-n // block),)](g2, u2, y, n, inter, g2.stride(0), u2.stride(0), float(alpha), float(beta),
                                     float(limit), BLOCK=block, num_warps=4)
    return y.view(gate.shape)
