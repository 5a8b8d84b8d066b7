"""Fused elementwise steps of the decoder layer: RMSNorm (Gemma or plain; alone or after the residual add), the
residual adds in order, per-head norm + RoPE, SwiGLU-OAI, and the small steps of a decode token (T = 1 over
a cache): the per-head norms + RoPE + cache writes of the fused q/k/v(/index) projection, the indexer's
block scores + top-k, the router's fp32 logits and top-k selection.

On CUDA each runs as one Triton kernel (runtime/kernels/fused_triton.py); elsewhere `use_triton` is False and
the model files (runtime/models/) run their torch reference. Same math: fp32 inside, the normed value rounded
to the compute dtype before RoPE as the reference does; the fused RoPE and SwiGLU round once at the end
where the reference rounds after every op (differences of an ulp of the compute dtype; none in fp32).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def _have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Whether x's op runs a Triton kernel (CUDA tensor, triton installed; checked once per process):
    the one test of the fused steps, runtime.kernels.attention's decode kernel and runtime.kernels.gemv."""
    return x.is_cuda and _have_triton()


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: SM90+, and not under Triton's interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl(device: torch.device) -> dict:
    """Launch options of the decode kernels: programmatic dependent launch on SM90+ (the kernel is
    launched while its predecessor drains and waits in-kernel for its writes, which hides most of the
    launch gap between the ~15 small kernels of a decode step). With it the kernel's USE_PDL constexpr is
    set too (its in-kernel wait; default False)."""
    return {"launch_pdl": True, "USE_PDL": True} if pdl_supported(device) else {}


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): Triton block extents."""
    return 1 << (max(n, 1) - 1).bit_length()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """x [..., N], w [N] -> [..., N] in x's dtype, scaled by offset + w (1.0: Gemma's delta; 0.0: plain)."""
    return _rms_norm(x, w, eps, offset=offset)[1]


def add_rms_norm(
    a: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, h [..., N] (a residual branch and the residual stream), w [N] -> (h + a, rms_norm(h + a, w)) in one
    kernel, each as the unfused torch add and rms_norm round them."""
    return _rms_norm(h, w, eps, add=a, offset=offset)


def _rms_norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, add: Optional[torch.Tensor] = None, offset: float = 1.0
):
    """rms_norm_kernel over x's rows (ADD: of x + add, which it also returns) -> (x + add or None, normed)."""
    from runtime.kernels.fused_triton import rms_norm_kernel

    n = x.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    ac, hout = (add.contiguous(), torch.empty_like(xc)) if add is not None else (xc, y)  # unused without ADD
    rms_norm_kernel[(xc.numel() // n,)](
        xc,
        w,
        y,
        ac,
        hout,
        n,
        eps,
        offset,
        BLOCK=next_pow2(n),
        ADD=add is not None,
        num_warps=8 if n >= 4096 else 4,
        **pdl(x.device),
    )
    return (hout if add is not None else None), y


def add_chain(x0: torch.Tensor, x1: torch.Tensor, x2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(x0 + x1) [+ x2] of same-shape, same-dtype tensors, rounded after each add as torch's adds are."""
    from runtime.kernels.fused_triton import add_chain_kernel

    if any(x.shape != x0.shape or x.dtype != x0.dtype for x in (x1, x2) if x is not None):
        raise ValueError("add_chain: the tensors must share shape and dtype (no broadcasting or promotion)")
    xs = [x.contiguous() for x in (x0, x1)]
    xs.append(xs[0] if x2 is None else x2.contiguous())  # x2's slot is not read without THREE
    y = torch.empty_like(xs[0])
    n, block = y.numel(), 1024
    add_chain_kernel[(-(-n // block),)](
        *xs, y, n, THREE=x2 is not None, BLOCK=block, num_warps=4, **pdl(y.device)
    )
    return y


def norm_rope(
    x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [B, T, n, d], w [d], cos/sin [B, T, r] in x's dtype -> RoPE(rms_norm(x)) [B, T, n, d]."""
    from runtime.kernels.fused_triton import norm_rope_kernel

    B, T, n, d = x.shape
    r = cos.shape[-1]
    xc = x.contiguous()
    y = torch.empty_like(xc)
    norm_rope_kernel[(B * T * n,)](
        xc,
        w,
        cos.contiguous(),
        sin.contiguous(),
        y,
        n,
        d,
        r,
        eps,
        BLOCK=next_pow2(d),
        num_warps=1 if d <= 128 else 4,
    )
    return y


def swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, beta: float, limit: float) -> torch.Tensor:
    """gate/up [M, I] (row strides may differ from I: e.g. halves of one [M, 2I] GEMM) -> [M, I]."""
    from runtime.kernels.fused_triton import swiglu_kernel

    inter = gate.shape[-1]
    g2, u2 = gate.reshape(-1, inter), up.reshape(-1, inter)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    n = y.numel()
    block = 1024
    swiglu_kernel[(-(-n // block),)](
        g2,
        u2,
        y,
        n,
        inter,
        g2.stride(0),
        u2.stride(0),
        float(alpha),
        float(beta),
        float(limit),
        BLOCK=block,
        num_warps=4,
    )
    return y.view(gate.shape)


def decode_qkv(
    qkv: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norms: tuple,
    heads: tuple,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    eps: float,
    idx_cache: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One decode token per row. qkv [B, nq*d + 2*nkv*d (+ ni*di + di)] (the fused projection), pos [B],
    cos/sin [B, 1, r], norms (q, k[, index q, index k]) weights, heads (nq, nkv, d[, ni, di]) -> q [B, nq, d]
    and index q [B, ni, di] (or None); k, v (and the index key) are written into the caches at slot pos[b]
    (k/v_cache [B, nkv, S, d], idx_cache [B, S, di])."""
    from runtime.kernels.fused_triton import decode_qkv_kernel

    B = qkv.shape[0]
    pos = pos.contiguous()  # the kernel reads pos[b] at pos_ptr + b (Step.of's expand() has stride 0)
    nq, nkv, d = heads[:3]
    index = idx_cache is not None
    ni, di = heads[3:] if index else (0, d)
    r = cos.shape[-1]
    q = torch.empty((B, nq, d), dtype=qkv.dtype, device=qkv.device)
    iq = torch.empty((B, ni, di), dtype=qkv.dtype, device=qkv.device) if index else None
    qn, kn = norms[:2]
    iqn, ikn = norms[2:] if index else (qn, kn)
    ic = idx_cache if index else k_cache
    cos2, sin2 = cos.reshape(B, r), sin.reshape(B, r)
    decode_qkv_kernel[(B, nq + 2 * nkv + (ni + 1 if index else 0))](
        qkv,
        pos,
        cos2,
        sin2,
        qn,
        kn,
        iqn,
        ikn,
        q,
        k_cache,
        v_cache,
        iq if index else q,
        ic,
        qkv.stride(0),
        cos2.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        ic.stride(0),
        ic.stride(1),
        nq,
        nkv,
        ni,
        d,
        di,
        r,
        min(r, di),
        eps,
        INDEX=index,
        BLOCK=next_pow2(max(d, di)),
        num_warps=1 if max(d, di) <= 128 else 4,
        **pdl(qkv.device),
    )
    return q, iq


def index_scores(
    iq: torch.Tensor,
    idx_cache: torch.Tensor,
    pos: torch.Tensor,
    kv_len: int,
    block: int,
    local_blocks: int,
    init_blocks: int,
) -> torch.Tensor:
    """Decode indexer: iq [B, ni, di] against the cached index keys [B, S_max, di] over slots < kv_len ->
    block scores [B, ni, nblk] fp32: the max of iq . index key over each block's visible slots, -inf where
    none is visible, +inf for the blocks every query keeps (index_topk of them = Indexer.select's pick)."""
    from runtime.kernels.fused_triton import index_scores_kernel

    B, ni, di = iq.shape
    pos = pos.contiguous()  # read at pos_ptr + b
    nblk = -(-kv_len // block)
    scores = torch.empty((B, ni, nblk), dtype=torch.float32, device=iq.device)
    index_scores_kernel[(B, nblk)](
        iq.contiguous(),
        idx_cache,
        pos,
        scores,
        kv_len,
        nblk,
        idx_cache.stride(0),
        idx_cache.stride(1),
        NI=ni,
        NIP=max(16, next_pow2(ni)),
        DI=di,
        DIP=max(16, next_pow2(di)),
        KB=block,
        KBP=max(16, next_pow2(block)),
        LOCAL=local_blocks,
        INIT=init_blocks,
        IEEE=iq.dtype == torch.float32,
        num_warps=4,
        **pdl(iq.device),
    )
    return scores


def index_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Block scores [B, n, nblk] fp32 -> the topk best blocks [B, n, topk] int64, best first (equal scores:
    lower block first; a pick whose score is -inf is nblk = none)."""
    from runtime.kernels.fused_triton import index_topk_kernel

    B, n, nblk = scores.shape
    top = torch.empty((B, n, topk), dtype=torch.int64, device=scores.device)
    nbp = next_pow2(nblk)  # one warp up to 512 blocks (64k keys): its reductions need no shared memory
    index_topk_kernel[(B * n,)](
        scores.contiguous(),
        top,
        nblk,
        TOPK=topk,
        NBP=nbp,
        num_warps=1 if nbp <= 512 else 4,
        **pdl(scores.device),
    )
    return top


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H] (T <= 64), router weight [E, H] fp32 contiguous -> fp32 logits [T, E] = x.float() @ weight.t().
    With PDL the kernel reads the weight before waiting for the previous kernel, so the weight must not be
    written by the kernel launched just before (a load-time tensor; a copy made here would be)."""
    from runtime.kernels.fused_triton import router_logits_kernel

    T, K = x.shape
    E = weight.shape[0]
    xc = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((T, E), dtype=torch.float32, device=x.device)
    bm = max(2, next_pow2(T))  # no size-1 block extents
    bk = max(64, min(next_pow2(K), 8192 // bm))  # one row, K 6144: two steps (each a dependent load)
    if not weight.is_contiguous():
        raise ValueError("router_logits: the router weight must be contiguous (made so at load)")
    router_logits_kernel[(E,)](
        xc, weight, out, T, E, K, xc.stride(0), BM=bm, BK=bk, num_warps=4, **pdl(x.device)
    )
    return out


def router_select(logits: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 router logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32), as
    runtime.moe.contract.select_experts."""
    from runtime.kernels.fused_triton import router_select_kernel

    T, E = logits.shape
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    router_select_kernel[(T,)](
        logits.contiguous(),
        bias,
        ids,
        w,
        E,
        TOPK=top_k,
        KP=next_pow2(top_k),
        EP=next_pow2(E),
        num_warps=4,
        **pdl(logits.device),
    )
    return ids, w
