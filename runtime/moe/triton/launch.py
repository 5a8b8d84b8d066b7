"""The Triton MoE launcher: which path a call takes (Plan), token alignment and the kernel launches.

Paths (launches), runtime/moe/triton/kernels.py has the details:
  * NOSORT (T <= NOSORT_MAX_TOKENS): [prescale], GEMM1, GEMM2 writing the output directly (fused output,
    one token; with more tokens prep also zeroes the fp32 output and a cast follows);
  * sorted: prep (align in kernel or in torch, prescale or e4m3 quantize, zeroing), GEMM1,
    [FP8: act quantize], GEMM2 (atomics), cast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from runtime.kernels.fused import next_pow2, pdl_supported
from runtime.moe.triton.config import (
    ALIGN_IN_KERNEL_MAX_SLOTS,
    FP8_BLOCK_K,
    FP8_ROW_SCALE,
    FUSED_OUT_MAX_TOKENS,
    NOSORT_MAX_TOKENS,
    NOSORT_PREFETCH_BYTES,
    MoeConfig,
    Quant,
    WMode,
    default_config,
    fit_config,
    max_blocks,
)
from runtime.moe.triton.prepare import PreparedMoE

_out_scratch: dict = {}


def fp8_prefill_supported(device: torch.device) -> bool:
    """The FP8 prefill path needs fp8 MMA (SM89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@dataclass(frozen=True)
class Plan:
    """The path of one call: tiles, whether routed slots skip the sort, whether GEMM2 writes the output
    itself (fused_out) and whether the prep kernel aligns the tokens."""

    cfg: MoeConfig
    nosort: bool
    fused_out: bool
    in_kernel_align: bool

    @property
    def fp8(self) -> bool:
        return self.cfg.fp8 > 0


def plan(
    p: PreparedMoE,
    t: int,
    k: int,
    h: int,
    cfg: Optional[MoeConfig],
    nosort: Optional[bool],
    fused_out: Optional[bool],
    fp8_prefill: bool,
    device: torch.device,
    mxfp8_act: bool = False,
) -> Plan:
    """mxfp8_act (the serving numerics): the FP8 path with one e4m3 term (MXFP8 values are e4m3 already,
    docs/moe-backends.md); GEMM1 tiles of whole 32-column blocks (its epilogue rounds per block)."""
    inter, n = p.w2.shape[2], t * k
    cfg = cfg or default_config(t, fp8_prefill and p.w_fp8 and fp8_prefill_supported(device))
    if cfg.fp8 and (h % FP8_BLOCK_K or inter % FP8_BLOCK_K or not p.fp8_weights_fit()):
        cfg = default_config(t, False)  # K % 128 == 0 for the rebased blocks, and room for them
    if cfg.fp8 and not p.w_fp8:
        raise ValueError("MoeConfig.fp8 needs MXFP8 weights (float8_e4m3fn + uint8 scales)")
    nosort = (t <= NOSORT_MAX_TOKENS if nosort is None else nosort) and t <= 64 and not cfg.fp8
    # Fused output by default for one token only: with more tokens per program the last arriver has read
    # partial sums (docs/known-issues.md); an explicit fused_out=True is honoured on the NOSORT path.
    fused_out = (nosort and t == 1) if fused_out is None else fused_out
    fused_out = fused_out and nosort and t <= FUSED_OUT_MAX_TOKENS
    if nosort:  # a block's rows are the tokens (kernels._block_rows)
        cfg = replace(cfg, bm=max(16, next_pow2(t)))
    if mxfp8_act and cfg.fp8:
        cfg = replace(cfg, fp8=1)
    in_kernel_align = not nosort and n <= ALIGN_IN_KERNEL_MAX_SLOTS
    cfg = fit_config(cfg, h, inter)
    if mxfp8_act and cfg.bn1 % 32:
        raise ValueError("mxfp8_act needs GEMM1 tiles of whole 32-column blocks (BN1 % 32 == 0)")
    return Plan(cfg, nosort, fused_out, in_kernel_align)


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of routed slots by expert, each expert padded to block_m rows (torch, no sync).

    topk_ids [T, k] -> sorted_ids [MAXB*BM] int32 (slot id token*k+j; N=T*k on padding) and
    expert_ids [MAXB] int32 (expert of each BM block; num_experts past the last used block)."""
    flat = topk_ids.reshape(-1).long()  # [N]
    n = flat.numel()
    nblk = max_blocks(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)  # [E]
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount would sync (no CUDA graphs)
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)  # [E]
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # [N] slots grouped by expert, in slot order
    e_sorted = flat[order]
    pos = pad_start[e_sorted] + torch.arange(n, device=flat.device) - cnt_start[e_sorted]
    sorted_ids = torch.full((nblk * block_m,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[pos] = order.to(torch.int32)
    starts = torch.arange(nblk, device=flat.device) * block_m
    expert_ids = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return sorted_ids, expert_ids


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The in-kernel alignment alone (prep program 0); same outputs as align_tokens (tests)."""
    from runtime.moe.triton import kernels as K

    n = topk_ids.numel()
    nblk = max_blocks(n, num_experts, block_m)
    ep = next_pow2(num_experts + 1)
    dev = topk_ids.device
    sorted_ids = torch.empty(nblk * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nblk, dtype=torch.int32, device=dev)
    cursor = torch.empty(ep, dtype=torch.int32, device=dev)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    K.prep_kernel[(1,)](
        dummy,
        dummy,
        dummy,
        dummy,
        dummy,
        topk_ids.contiguous(),
        sorted_ids,
        expert_ids,
        cursor,
        0,
        1,
        n,
        num_experts,
        nblk,
        1,
        DO_ALIGN=True,
        QUANT=int(Quant.NONE),
        ZERO_OUT=False,
        HP=16,
        BM=block_m,
        EP=ep,
        C=64,
        CB=128,
        num_warps=8,
    )
    return sorted_ids, expert_ids


def _fused_out_scratch(device, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent zeroed fp32 [FUSED_OUT_MAX_TOKENS, H] accumulator and per (token, 16-column tile)
    arrival counters of the fused-output GEMM2 (kept zeroed by the kernel's last arrivers). Allocated once
    per (device, H) at full size and never freed or grown, so CUDA graphs captured with these pointers stay
    valid (6.3 MB + 0.4 MB at H = 6144)."""
    key = (str(device), hidden)
    buf = _out_scratch.get(key)
    if buf is None:
        buf = (
            torch.zeros(FUSED_OUT_MAX_TOKENS * hidden, dtype=torch.float32, device=device),
            torch.zeros(FUSED_OUT_MAX_TOKENS * ((hidden + 15) // 16), dtype=torch.int32, device=device),
        )
        _out_scratch[key] = buf
    return buf


def _alignment(pl: Plan, topk_ids: torch.Tensor, e: int, ep: int):
    """-> (blocks, padded rows, sorted_ids, expert_ids, cursor) for the GEMMs' grids."""
    n, bm, dev = topk_ids.numel(), pl.cfg.bm, topk_ids.device
    if pl.nosort:  # one (mostly masked) BM block per routed slot; block m's expert is topk_ids[m]; act rows
        return n, n, topk_ids, topk_ids, topk_ids  # are slot ids
    nblk = max_blocks(n, e, bm)
    if pl.in_kernel_align:  # filled by the prep kernel
        return (
            nblk,
            nblk * bm,
            torch.empty(nblk * bm, dtype=torch.int32, device=dev),
            torch.empty(nblk, dtype=torch.int32, device=dev),
            torch.empty(ep, dtype=torch.int32, device=dev),
        )
    sorted_ids, expert_ids = align_tokens(topk_ids, e, bm)
    return nblk, nblk * bm, sorted_ids, expert_ids, sorted_ids


def _prefetch_cols(prefetch: int, h: int) -> int:
    """GEMM1's NOSORT prefetch extent along K: a power of two of whole 128-element lines, within H (0: none)."""
    cols = min(prefetch, 1 << (h.bit_length() - 1))
    return cols if cols >= 128 else 0


def _weights(p: PreparedMoE, pl: Plan, fp8_row_scale: bool, promote: bool):
    """-> (w13, s13, w2, s2, wmode1, wmode2) the GEMMs read on this path; promote: FP8 row scales with
    fp32 accumulation of every 128-K partial."""
    if not pl.fp8:
        return p.w13, p.w13_scale, p.w2, p.w2_scale, p.wmode1, p.wmode2
    w13, s13, w2, s2 = p.fp8_weights(fp8_row_scale)
    rows = WMode.FP8_ROWS_PROMOTED if promote else WMode.FP8_ROWS
    mode = rows if p.fp8_row_scale else WMode.FP8_BLOCKS
    return w13, s13, w2, s2, mode, mode


def fused_moe(
    p: PreparedMoE,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_scaling_factor: float,
    cfg: MoeConfig | None = None,
    nosort: bool | None = None,
    fused_out: bool | None = None,
    fp8_prefill: bool = True,
    fp8_row_scale: bool = FP8_ROW_SCALE,
    mxfp8_act: bool = False,
    weight_prefetch: bool | None = None,
) -> torch.Tensor:
    """hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H] in hidden's dtype.

    cfg / nosort / fused_out override the path choice (tests, benchmarks; cfg.fp8 runs the sorted path);
    fp8_prefill: the FP8 path from FP8_PREFILL_MIN_TOKENS on (SM89+); fp8_row_scale: its weights with one
    scale per row, else per (row, 128 K). mxfp8_act: the serving numerics: the prep kernel rounds each
    input row, GEMM1's epilogue its SwiGLU output, to the MXFP8 values the serving kernel reads
    (kernels._mxfp8_round); the W8A16 GEMMs multiply those exact values, the FP8 path re-expresses them as
    one e4m3 term per row (exact but for values below 2^-6 of their row's scale, docs/moe-backends.md).
    weight_prefetch (NOSORT, SM90): GEMM1 prefetches its first weight lines while the prep kernel runs; None:
    with mxfp8_act only (measured: it hides the serving prep kernel's rounding, and gains nothing in w8a16)."""
    from runtime.moe.triton import kernels as K

    (t, h), k, e, dev = hidden.shape, topk_ids.shape[1], p.num_experts, hidden.device
    inter, n = p.w2.shape[2], t * topk_ids.shape[1]
    pl = plan(p, t, k, h, cfg, nosort, fused_out, fp8_prefill, dev, mxfp8_act)
    cfg = pl.cfg
    pdl = {"launch_pdl": True} if pdl_supported(dev) else {}
    hidden, topk_ids = hidden.contiguous(), topk_ids.contiguous()
    topk_w = topk_weights.reshape(-1).float().contiguous()  # [N]
    ep = next_pow2(e + 1)  # one spare histogram bin for padding lanes
    nblk, maxp, sorted_ids, expert_ids, cursor = _alignment(pl, topk_ids, e, ep)
    if pl.fused_out:
        scratch, out_counts = _fused_out_scratch(dev, h)
        out = scratch[: t * h].view(t, h)
        y = torch.empty((t, h), dtype=hidden.dtype, device=dev)
    else:
        out = torch.empty((t, h), dtype=torch.float32, device=dev)  # zeroed by prep, reduced by atomics
        y = out_counts = None
    # GEMM1's activation operand: [terms, T, H] e4m3 (FP8), [1, T, H] fp16 (W8A16 with guards) or hidden
    quant_x = Quant.e4m3(cfg.fp8) if pl.fp8 else (Quant.FP16 if p.fp16_1 else Quant.NONE)
    if mxfp8_act and quant_x == Quant.NONE:
        quant_x = Quant.BF16  # the prep kernel writes the rounded rows
    if pl.fp8:
        xq = torch.empty((cfg.fp8, t, h), dtype=torch.float8_e4m3fn, device=dev)
    elif quant_x != Quant.NONE:
        xq = torch.empty(
            (1, t, h), dtype=torch.float16 if quant_x == Quant.FP16 else torch.bfloat16, device=dev
        )
    else:
        xq = hidden[None]
    xscale = torch.empty(t, dtype=torch.float32, device=dev)
    prep = pl.in_kernel_align or quant_x != Quant.NONE or not pl.fused_out
    # NOSORT with PDL: GEMM1 starts streaming its weights while the prep kernel runs (kernels._prefetch_slab);
    # by default in the serving numerics only, whose prep kernel also rounds (docs/moe-backends.md)
    wants_prefetch = mxfp8_act if weight_prefetch is None else weight_prefetch
    early = prep and pl.nosort and bool(pdl) and wants_prefetch
    prefetch = _prefetch_cols(NOSORT_PREFETCH_BYTES, h) if early else 0  # 0: GEMM1 waits first
    if prep:
        K.prep_kernel[(t + int(pl.in_kernel_align),)](
            hidden,
            xq,
            xq[-1],
            xscale,
            out,
            topk_ids,
            sorted_ids,
            expert_ids,
            cursor,
            t,
            h,
            n,
            e,
            nblk,
            hidden.stride(0),
            DO_ALIGN=pl.in_kernel_align,
            QUANT=int(quant_x),
            ZERO_OUT=not pl.fused_out,
            MXFP8_ACT=mxfp8_act,
            LAUNCH_DEPENDENTS=prefetch > 0,
            HP=next_pow2(h),
            BM=cfg.bm,
            EP=ep,
            C=64,
            CB=128,
            num_warps=8,
        )
    w13, s13, w2, s2, wmode1, wmode2 = _weights(p, pl, fp8_row_scale, promote=mxfp8_act)
    ss13 = (s13.stride(0), s13.stride(1)) if p.w_fp8 else (0, 0)
    ss2 = (s2.stride(0), s2.stride(1)) if p.w_fp8 else (0, 0)
    # act rows in sorted (or slot) order; bf16 before the FP8 path's quantize kernel
    act_dtype = torch.float16 if p.fp16_2 and not pl.fp8 else torch.bfloat16
    act = torch.empty((maxp, inter), dtype=act_dtype, device=dev)
    # act stored scaled per row when the SwiGLU-OAI parameters do not bound it (prepare.act_bounds); the FP8
    # path's act is bf16 and re-scaled per row by its quantize kernel instead
    act_scale = p.act_bound is not None and not pl.fp8
    if act_scale and quant_x != Quant.FP16:
        raise ValueError("act scaling needs GEMM1's fp16 prescaled tokens (PreparedMoE.fp16_1)")
    extras = dict(
        alpha_ptr=p.alpha,
        beta_ptr=p.beta,
        limit_ptr=p.limit,
        bound_ptr=p.act_bound if act_scale else xscale,  # (a dummy pointer when unused)
        ACT_SCALE=act_scale,
    )
    n1 = inter // cfg.bn1
    K.gemm1_swiglu_kernel[(nblk * n1,)](
        xq,
        t * h,
        xscale,
        w13,
        s13,
        p.shift13,
        p.epi13,
        p.alpha,
        p.beta,
        p.limit,
        sorted_ids,
        expert_ids,
        act,
        n,
        h,
        inter,
        e,
        n1,
        xq.stride(1),
        w13.stride(0),
        w13.stride(1),
        *ss13,
        TOPK=k,
        WMODE=int(wmode1),
        PRESCALED=quant_x != Quant.NONE,
        TERMS=cfg.fp8,
        SWAP=cfg.swap1 and not pl.fp8,
        BM=cfg.bm,
        BN=cfg.bn1,
        BK=cfg.bk1,
        NOSORT=pl.nosort,
        USE_PDL=bool(pdl),
        MXFP8_ACT=mxfp8_act,
        PREFETCH=prefetch,
        bias_ptr=p.w13_bias if p.w13_bias is not None else xscale,
        bound_ptr=extras["bound_ptr"],
        HAS_BIAS=p.w13_bias is not None,
        ACT_SCALE=act_scale,
        num_warps=cfg.warps1,
        num_stages=cfg.stages1,
        **pdl,
    )
    if pl.fp8:  # act -> [terms, MAXP, I] e4m3 + per-row 2^m
        aq = torch.empty((cfg.fp8, maxp, inter), dtype=torch.float8_e4m3fn, device=dev)
        ascale = torch.empty(maxp, dtype=torch.float32, device=dev)
        K.quant_rows_kernel[(maxp,)](
            act,
            aq,
            aq[-1],
            ascale,
            sorted_ids,
            n,
            inter,
            QUANT=int(Quant.e4m3(cfg.fp8)),
            DP=next_pow2(inter),
            USE_PDL=bool(pdl),
            num_warps=8,
            **pdl,
        )
        act = aq
    else:
        act, ascale = act[None], xscale
    n2 = h // cfg.bn2
    K.gemm2_reduce_kernel[(nblk * n2,)](
        act,
        maxp * inter,
        ascale,
        w2,
        s2,
        p.shift2,
        p.epi2,
        topk_w,
        out,
        sorted_ids,
        expert_ids,
        n,
        inter,
        h,
        e,
        float(routed_scaling_factor),
        n2,
        w2.stride(0),
        w2.stride(1),
        *ss2,
        TOPK=k,
        WMODE=int(wmode2),
        TERMS=cfg.fp8,
        SWAP=cfg.swap2 and not pl.fp8,
        BM=cfg.bm,
        BN=cfg.bn2,
        BK=cfg.bk2,
        y_ptr=y if pl.fused_out else out,
        count_ptr=out_counts if pl.fused_out else out,
        NOSORT=pl.nosort,
        FUSED_OUT=pl.fused_out,
        USE_PDL=bool(pdl),
        bias_ptr=p.w2_bias if p.w2_bias is not None else xscale,
        HAS_BIAS=p.w2_bias is not None,
        **extras,
        num_warps=cfg.warps2,
        num_stages=cfg.stages2,
        **pdl,
    )
    return y if pl.fused_out else out.to(hidden.dtype)
