"""Hopper (SM90; runs on SM80+) MoE backend: Triton MXFP8 fused MoE reading the canonical tensors.

Kernels and the fp16 range-guard rules are in runtime/moe/triton_kernels.py. This module holds the
load-time guard computation (per-expert power-of-two offsets; no weight copy in any other format),
token alignment, launch-config choice and the TritonMoE class with TorchMoE's interface.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from porter import mxfp8
from porter.errors import BackendUnavailable
from runtime.fused import next_pow2
from runtime.moe.contract import MoeQuantInfo, MoeRouting, route

log = logging.getLogger("porter.runtime")

FP16_EXACT_BYTES = (112, 134)  # e8m0 bytes for which fp16(e4m3) * fp16(2^(s-127)) is exact
ACT_FP16_MAX_LOG2 = 15  # keep fp16 MMA operands below 2^15 (fp16 max is 65504)
ALIGN_IN_KERNEL_MAX_SLOTS = 1024  # above this the torch sort is cheaper than one-program align


@dataclass(frozen=True)
class MoeConfig:
    """Tile shapes. GEMM1 tiles are BN1 gate + BN1 matching up rows of w13 (one [2*BN1, BK1] weight
    tile and one MMA per K step); GEMM2 tiles BN2 rows of w2."""
    bm: int
    bn1: int
    bk1: int
    warps1: int
    stages1: int
    bn2: int
    bk2: int
    warps2: int
    stages2: int
    swap1: bool = False  # W8A16: weight as the left MMA operand (prefill, BM >= 64)
    swap2: bool = False
    fp8: int = 0  # 0: W8A16 (weights dequantized to fp16); 1 / 2: e4m3 activations in 1 / 2 terms, fp8 MMA


# Prefill path choice, measured on one H200 at MiniMax-M3 dims (E=128, H=6144, I=3072, top-4; whole layer,
# CUDA-graph medians, µs; benchmarks/moe_layer.py, benchmarks/results/moe_layer_NVIDIA_H200.md):
#   T      W8A16   FP8 2 terms   FP8 1 term (rel err 4.8e-2, over the 2e-2 bound: not used)
#   256    1888    2331          2217
#   1024   4132    2611          2389
#   4096   8041    6005          4998
# Between those points (round 12, rebased weights, benchmarks/results/moe_layer_round12_crossover_NVIDIA_H200.md
# and moe_layer_round12_NVIDIA_H200.md): W8A16 / FP8 2 terms 256: 1692 / 1857, 320: 1769 / 1919,
# 384: 1858 / 1945, 448: 1950 / 2014, 512: 2242 / 2007, 768: 2550 / 2066, 1024: 3336 / 2106. FP8 from 512 on.
# Rel error vs the torch reference: W8A16 3.9e-3, FP8 with two terms 4.2e-3. Those FP8 figures are for
# one weight scale per 128 K; one per row (FP8_ROW_SCALE, the default since) measured T=1024 2454 -> 2050,
# T=4096 5847 -> 4586 in one run, rel error 5.7e-3 (benchmarks/results/moe_round6_fp8_row_scale_ab.log).
FP8_PREFILL_MIN_TOKENS = 512  # the FP8 path from here on (when enabled), W8A16 below
FP8_TERMS = 2  # e4m3 terms per activation (one term: layer rel error 4.8e-2, over the 2e-2 bound)
FP8_PREFILL = None  # None: PORTER_MOE_FP8 env ("0" disables), default on
# Load-time rebase (prepare): where row_scale_ok holds for both GEMMs, the experts are kept as e4m3 with one
# power-of-two scale per row instead of the MXFP8 tensors, for every path (W8A16 WMODE 7, FP8 WMODE 5): no
# per-32 scale multiply in the weight stream (T=1..256 3.3-6% faster on the H200) and no second copy for
# the FP8 path. None: PORTER_MOE_REBASE env ("0" keeps the weights as stored), default on.
REBASE_AT_LOAD = None
_FP8_NO_ROOM_WARNED: list = []  # warn once per process
REBASE_MARGIN = 1.1  # free device memory the load-time rebase asks for, times its own bytes (rebase_fits)
FP8_COPY_MARGIN = 1.25  # the same for the FP8 path's copy of weights kept as stored (fp8_weights_fit)
_REBASE_NO_ROOM_WARNED: list = []


def default_config(num_tokens: int, fp8_prefill: bool = False) -> MoeConfig:
    """Tile configs from the H200 A/B (benchmarks/moe_ab_h200.py; benchmarks/results/bench_ab.log;
    decode re-checked with benchmarks/moe_decode_sweep.py, results/moe_decode_sweep_round5_call1.log,
    moe_decode_timing_round5.log and moe_decode_timing_round5_call3.log: at T=1 nothing beat BN 32/64,
    BK 256, 4 warps, 3 stages — GEMM1 41.2 us vs 43-78 us for BK 128/512, 2 or 8 warps, BN 16, the
    weights as wgmma left operand (61 us; T=4..64 1.4-1.6x slower) or as mma.sync left operand at 2
    warps (43.6 us, though ~19% fewer SASS instructions per weight byte); GEMM2 22.8 us vs 24-42 us).

    Decode (BM16): the doc's BN64/BK256/4 warps shape; GEMM1 as one fused [gate; up] tile of
    2 x 32 rows. Split-K does not pay once the dequant is hoisted (T=1: 85 us unsplit vs 92 us
    split 2), so there is none. 4 stages for 5..128 tokens, 3 elsewhere. BM32 at <= 1024 tokens (~32
    rows per expert: every weight tile streamed once). W8A16 prefill: wgmma tiles, BM128 from 2048
    tokens (T=4096: 8.90 ms vs 9.67 ms for BM64), GEMM1 as one fused [gate; up] 128-row tile (T=4096:
    GEMM1 5.17 ms vs 6.05 ms for two 64-row tiles). T <= 4 runs the NOSORT path (fused_moe), which
    forces BM = 16. fp8_prefill: the FP8 path at T >= FP8_PREFILL_MIN_TOKENS, tile from the H200 A/B at
    T=4096 (benchmarks/results/bench_ab.log: BM64/4 warps/3 stages 5.94 ms; 4 stages 6.73, BM128/8 warps
    7.28, 64x256 tiles 10.5)."""
    if fp8_prefill and num_tokens >= FP8_PREFILL_MIN_TOKENS:
        return MoeConfig(64, 64, 128, 4, 3, 128, 128, 4, 3, fp8=FP8_TERMS)
    if num_tokens <= 4:
        return MoeConfig(16, 32, 256, 4, 3, 64, 256, 4, 3)
    if num_tokens <= 128:
        return MoeConfig(16, 32, 256, 4, 4, 64, 256, 4, 4)
    if num_tokens <= 512:
        return MoeConfig(16, 32, 256, 4, 3, 64, 256, 4, 3)
    if num_tokens <= 1024:
        return MoeConfig(32, 32, 256, 4, 3, 64, 256, 4, 3)
    if num_tokens < 2048:
        return MoeConfig(64, 64, 128, 8, 3, 128, 64, 4, 4)
    return MoeConfig(128, 64, 128, 8, 3, 128, 128, 8, 3)


def fit_config(cfg: MoeConfig, hidden: int, inter: int) -> MoeConfig:
    """Shrink tiles so BN divides N and BK divides K (no masks in the weight stream)."""
    def div(b, n):  # n is a multiple of 32 (MXFP8), so this stops at >= 32 for b >= 32
        while n % b:
            b //= 2
        return b

    if cfg.fp8 and (hidden % FP8_BLOCK_K or inter % FP8_BLOCK_K):
        cfg = replace(cfg, fp8=0)  # the rebased weight blocks need K % 128 == 0: W8A16 instead
    if cfg.fp8:  # one K step per rebased weight block
        return replace(cfg, bn1=div(cfg.bn1, inter), bk1=FP8_BLOCK_K, bn2=div(cfg.bn2, hidden), bk2=FP8_BLOCK_K)
    return replace(cfg, bn1=div(cfg.bn1, inter), bk1=div(cfg.bk1, hidden), bn2=div(cfg.bn2, hidden),
                   bk2=div(cfg.bk2, inter))


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case BM blocks after padding each used expert to BM (grid size without a host sync)."""
    return (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m


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


def weight_shifts(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Per-expert power-of-two offsets d_e moving the e8m0 bytes into the fp16-exact window.

    scale [E, N, K/32] uint8 -> (d [E] int32 on CPU, fp16_ok). fp16_ok is False when some expert's
    nonzero bytes span more than the window (22 octaves): that GEMM then runs in bf16."""
    flat = scale.reshape(scale.shape[0], -1)  # [E, N*K/32]
    smax = flat.amax(dim=1).to(torch.int32).cpu()
    smin = torch.where(flat == 0, torch.full_like(flat, 255), flat).amin(dim=1).to(torch.int32).cpu()
    lo, hi = FP16_EXACT_BYTES
    fp16_ok = True
    shifts = []
    for a, b in zip(smin.tolist(), smax.tolist()):
        if b == 0:  # all-zero expert
            shifts.append(0)
            continue
        if b - a > hi - lo:
            fp16_ok = False
        shifts.append(min(max(0, b - hi), a - lo))  # d in [b-hi, a-lo], 0 when already inside
    return torch.tensor(shifts, dtype=torch.int32), fp16_ok


FP8_BLOCK_K = 128  # the FP8 path's K step, and the K extent of one rebased weight scale
FP8_ROW_SCALE = True  # one rebased weight scale per row (whole K; faster) instead of per 128 K (more exact)


ROW_SCALE_MAX_OCTAVES = 13  # see row_scale_ok


def row_scale_ok(scale: torch.Tensor) -> bool:
    """Whether one rebased scale per row (FP8_ROW_SCALE) adds no more error than MXFP8 itself did: a 32-group
    whose scale byte is d below its row's largest is shifted d octaves down, and the bits that fall below
    e4m3's smallest subnormal (2^-9 of the row's scale) are rounded off, at most 2^(d-10) of the group's own
    scale per value. With porter's scale rule (rceil) a group's amax is over 224 of its scale, where e4m3's
    half-ulp is 8, so d <= 13 keeps the shift's error at or below the rounding the group's largest values
    already carry.
    scale [E, N, K/32] uint8; byte-0 groups (values below 448 * 2^-127, read as 0) are ignored."""
    for s in scale:  # one expert at a time: int16 temporaries of one expert
        s = s.to(torch.int16)  # [N, K/32]
        low = s.masked_fill(s == 0, 255).amin(dim=-1)  # [N] smallest non-zero byte (255: none)
        if bool((s.amax(dim=-1) - low > ROW_SCALE_MAX_OCTAVES).any()):
            return False
    return True


def rebase_fp8(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 (q [E, N, K] e4m3, scale [E, N, K/32] uint8) -> block FP8 for the fp8 MMA: (q' [E, N, K]
    e4m3, sc [E, N, K/block] fp32) with sc = 2^(S-127), S the largest of the block's scale bytes,
    and q' = rne_e4m3(q * 2^(s-S)). The shift is exact wherever the shifted value stays in e4m3's normal
    range; only values of a 32-group whose scale lies several octaves below its block's largest lose
    low bits (one scale per 128: rel error <= 2e-6 on Gaussian and outlier-column weights with per-group
    jitter; per whole 6144-wide row <= 1e-5; a test bounds both). One expert at a time (fp32 temporaries
    of one expert)."""
    e, n, k = q.shape
    out_q = torch.empty_like(q)
    out_s = torch.empty((e, n, k // block), dtype=torch.float32, device=q.device)
    g = block // mxfp8.BLOCK
    for i in range(e):
        s = scale[i].to(torch.int32).reshape(n, k // block, g)  # [N, K/block, block/32]
        top = s.amax(dim=-1, keepdim=True)
        vals = q[i].float().reshape(n, k // block, g, mxfp8.BLOCK) * mxfp8.pow2(s - top)[..., None]
        out_q[i] = vals.reshape(n, k).to(torch.float8_e4m3fn)
        out_s[i] = mxfp8.pow2(top[..., 0] - mxfp8.SCALE_BIAS)
    return out_q, out_s


def act_fp16_ok(alpha: torch.Tensor, beta: torch.Tensor, limit: torch.Tensor) -> bool:
    """True when |SwiGLU-OAI| < 2^15 for every expert, from the bound max(|L|, 0.2785/alpha)(|L|+|b|)
    (0.2785 = max over g < 0 of |g sigmoid(g)|): then act can be stored in fp16 for GEMM2.
    A larger bound (or alpha <= 0, limit = inf) means act may leave fp16's range: bf16 instead."""
    a, b, lim = alpha.double().cpu(), beta.double().cpu(), limit.double().abs().cpu()
    if not bool((a > 0).all()):
        return False
    bound = torch.maximum(lim, 0.2785 / a) * (lim + b.abs())
    return bool((bound < 2.0 ** ACT_FP16_MAX_LOG2).all())


@dataclass
class PreparedMoE:
    """Device tensors the kernels read: the caller's tensors, or (rebased) the experts rebased at load to
    one power-of-two scale per row, which replace them (the caller's copy can then be freed)."""
    w13: torch.Tensor  # [E, 2I, H] float8_e4m3fn (or bf16 for the benchmark baseline)
    w13_scale: torch.Tensor  # [E, 2I, H/32] uint8 (dummy for bf16); rebased: [E, 2I, 1] fp32 row scales
    w2: torch.Tensor  # [E, H, I]
    w2_scale: torch.Tensor  # [E, H, I/32] uint8; rebased: [E, H, 1] fp32
    alpha: torch.Tensor  # [E] fp32
    beta: torch.Tensor
    limit: torch.Tensor
    w_fp8: bool
    fp16_1: bool  # GEMM1 in fp16 (guards hold) else bf16
    fp16_2: bool
    shift13: torch.Tensor  # [E] int32, d_e of w13
    shift2: torch.Tensor  # [E] int32
    epi13: torch.Tensor  # [E] fp32, 2^d_e
    epi2: torch.Tensor  # [E] fp32, 2^d_e
    wmode1: int = 1  # kernel WMODE of GEMM1 / GEMM2 (see _wmode)
    wmode2: int = 1
    fp8_blocks: Optional[tuple] = None  # the FP8 path's rebased weights, made on first use (fp8_weights)
    fp8_row_scale: bool = False  # whether fp8_blocks has one scale per row or per (row, 128 K)
    fp8_requested: Optional[bool] = None  # the row_scale fp8_blocks was made for
    rebased: bool = False  # w13 / w2 are the load-time rebase (WMODE 7 / 5), not the MXFP8 tensors

    def fp8_weights(self, row_scale: bool) -> tuple:
        """(w13 e4m3 [E, 2I, H], s13 fp32 [E, 2I, H/128], w2 e4m3 [E, H, I], s2 fp32 [E, H, I/128]):
        the weights rebased to one power-of-two scale per (row, 128 K), or with row_scale per row (s13
        [E, 2I, 1], s2 [E, H, 1]) where row_scale_ok holds for both (else per 128 K; fp8_row_scale says
        which). A layer rebased at load returns its own tensors (one scale per row, whatever row_scale
        asks: the MXFP8 bytes per 128 K are gone). Otherwise the copy is made once per layer on the first
        FP8 prefill call: a second copy of the experts in e4m3 (1 B per weight + 1/32 B of scales: 7.5 GB
        per MiniMax-M3 layer); FP8_PREFILL = False / PORTER_MOE_FP8=0 avoids it."""
        if self.rebased:
            self.fp8_row_scale = True
            return self.w13, self.w13_scale, self.w2, self.w2_scale
        if self.fp8_blocks is None or self.fp8_requested != row_scale:
            self.fp8_blocks = None  # a switched A/B frees the other copy first
            rows = row_scale and row_scale_ok(self.w13_scale) and row_scale_ok(self.w2_scale)
            if row_scale and not rows:
                log.info("FP8 prefill: a weight row spans more than %d octaves of MXFP8 scales; this layer "
                         "keeps one scale per 128 K", ROW_SCALE_MAX_OCTAVES)
            b13 = self.w13.shape[2] if rows else FP8_BLOCK_K
            b2 = self.w2.shape[2] if rows else FP8_BLOCK_K
            self.fp8_blocks = (*rebase_fp8(self.w13, self.w13_scale, b13), *rebase_fp8(self.w2, self.w2_scale, b2))
            self.fp8_row_scale, self.fp8_requested = rows, row_scale
        return self.fp8_blocks

    def fp8_weights_fit(self) -> bool:
        """Whether the rebased copy (fp8_weights) exists or fits in the device's free memory with
        FP8_COPY_MARGIN (has_room). A fully resident model leaves no room for a second copy of every
        layer's experts; then prefill stays on the W8A16 path instead of dying with an out-of-memory error."""
        if self.fp8_blocks is not None or self.rebased:
            return True
        need = (self.w13.numel() + self.w2.numel()) * (1 + 4 / FP8_BLOCK_K)  # e4m3 + fp32 per 128
        return has_room(self.w13.device, need, FP8_COPY_MARGIN, _FP8_NO_ROOM_WARNED,
                        "FP8 prefill path off: its rebased expert copy needs %.1f GB per layer, %.1f GB "
                        "free; prefill runs on the W8A16 path (same results, slower)")

    @staticmethod
    def _wmode(w_fp8: bool, fp16: bool, shift: torch.Tensor) -> int:
        """The kernels' WMODE: 0 16-bit weights, 1 fp16 (no offset, fast), 2 fp16 + per-expert
        offset, 3 bf16 fallback. (7: rebased at load, see prepare; 4 / 5, the FP8 path's rebased weights,
        are chosen per call.)"""
        if not w_fp8:
            return 0
        if not fp16:
            return 3
        return 2 if bool(shift.ne(0).any()) else 1

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def rebase_at_load() -> bool:
    return _switch(REBASE_AT_LOAD, "PORTER_MOE_REBASE")


def device_free_bytes(dev: torch.device) -> Optional[int]:
    """Bytes a new allocation on dev can take: the driver's free memory plus what torch's caching
    allocator holds unused (a previous layer's freed tensors). None off CUDA (host memory is not checked)."""
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)


def has_room(dev: torch.device, need: int, margin: float, warned: list, message: str) -> bool:
    """Whether device_free_bytes(dev) holds margin * need bytes (always off CUDA). If not, message (a log
    format taking the needed and the free GB) is logged once per process (warned: that message's flag)."""
    free = device_free_bytes(dev)
    if free is None or free >= margin * need:
        return True
    if not warned:
        warned.append(True)
        log.warning(message, need / 1e9, free / 1e9)
    return False


def rebase_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Peak bytes the load-time rebase allocates while the stored tensors are still held: the rebased
    e4m3 copies and fp32 row scales of both GEMMs, plus rebase_fp8's fp32 temporaries of one expert
    (two [N, K] fp32 arrays of the larger matrix)."""
    rows = w13.shape[0] * (w13.shape[1] + w2.shape[1])
    one_expert = max(w13[0].numel(), w2[0].numel())
    return w13.numel() + w2.numel() + 4 * rows + 2 * 4 * one_expert


def rebase_fits(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the device has room for the rebase (rebase_bytes, REBASE_MARGIN): until the layer drops the
    stored tensors both copies are resident, so a GPU packed to its weight budget could otherwise run out
    of memory at load. Without room the layer keeps the stored layout (same results, 3-6% slower decode
    at T=1..256)."""
    return has_room(w13.device, rebase_bytes(w13, w2), REBASE_MARGIN, _REBASE_NO_ROOM_WARNED,
                    f"MoE experts kept as stored on {w13.device}: rebasing a layer at load needs %.1f GB free "
                    "for a moment, %.1f GB are; decode runs on the stored layout (same results, 3-6%% slower)")


def prepare(w13, w13_scale, w2, w2_scale, alpha, beta, limit) -> PreparedMoE:
    """Load-time guard analysis: reads the scales once. MXFP8 weights whose rows each span at most
    ROW_SCALE_MAX_OCTAVES of scales (row_scale_ok), with SwiGLU-OAI's output in fp16's range, are rebased
    to one power-of-two scale per row (REBASE_AT_LOAD; against the MXFP8 values rel error <= 1e-5) and
    the result replaces them: the weight stream then converts e4m3 -> fp16 with no per-32 scale multiply
    (WMODE 7) and the FP8 path reads the same tensors, where the device has room for both copies for a
    moment (rebase_fits). Otherwise it keeps references to the stored tensors."""
    dev, e = w13.device, w13.shape[0]
    w_fp8 = w13_scale is not None
    if (w_fp8 and rebase_at_load() and act_fp16_ok(alpha, beta, limit) and row_scale_ok(w13_scale)
            and row_scale_ok(w2_scale) and rebase_fits(w13, w2)):
        w13, s13 = rebase_fp8(w13, w13_scale, w13.shape[2])  # [E, 2I, H] e4m3, [E, 2I, 1] fp32
        w2, s2 = rebase_fp8(w2, w2_scale, w2.shape[2])
        zero, one = torch.zeros(e, dtype=torch.int32, device=dev), torch.ones(e, dtype=torch.float32, device=dev)
        return PreparedMoE(w13, s13, w2, s2, alpha, beta, limit, True, True, True, zero, zero, one, one,
                           7, 7, fp8_row_scale=True, rebased=True)
    if w_fp8:
        d13, ok13 = weight_shifts(w13_scale)
        d2, ok2 = weight_shifts(w2_scale)
    else:
        d13, ok13 = torch.zeros(e, dtype=torch.int32), False
        d2, ok2 = torch.zeros(e, dtype=torch.int32), False
        w13_scale = w2_scale = torch.zeros(1, dtype=torch.uint8, device=dev)
    ok2 = ok2 and act_fp16_ok(alpha, beta, limit)
    d13 = d13 if ok13 else torch.zeros_like(d13)  # the bf16 path decodes the raw bytes
    d2 = d2 if ok2 else torch.zeros_like(d2)
    pow2 = lambda t: torch.ldexp(torch.ones(e, dtype=torch.float32), t.float()).to(dev)
    return PreparedMoE(w13, w13_scale, w2, w2_scale, alpha, beta, limit, w_fp8, ok13, ok2,
                       d13.to(dev), d2.to(dev), pow2(d13), pow2(d2),
                       PreparedMoE._wmode(w_fp8, ok13, d13), PreparedMoE._wmode(w_fp8, ok2, d2))


_out_scratch: dict = {}
FUSED_OUT_MAX_TOKENS = 256  # fused-output path up to here: persistent fp32 scratch of T x H
NOSORT_MAX_SLOTS = 16  # T * top_k up to here: no alignment, one block per routed slot (BM 16)
USE_PDL = None  # programmatic dependent launch of the GEMMs (SM90+); None: PORTER_MOE_PDL env, default on


def _fused_out_scratch(device, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent zeroed fp32 [FUSED_OUT_MAX_TOKENS, H] accumulator and per (token, 16-column tile)
    arrival counters of the fused-output GEMM2 (kept zeroed by the kernel's last arrivers).
    Allocated once per (device, H) at full size and never freed or grown, so CUDA graphs captured
    with these pointers stay valid. Memory: FUSED_OUT_MAX_TOKENS * H * 4 B (6.3 MB at H = 6144) plus
    FUSED_OUT_MAX_TOKENS * H / 4 B of counters."""
    key = (str(device), hidden)
    buf = _out_scratch.get(key)
    if buf is None:
        buf = (torch.zeros(FUSED_OUT_MAX_TOKENS * hidden, dtype=torch.float32, device=device),
               torch.zeros(FUSED_OUT_MAX_TOKENS * ((hidden + 15) // 16), dtype=torch.int32, device=device))
        _out_scratch[key] = buf
    return buf


def _switch(flag: Optional[bool], env: str) -> bool:
    """A module switch: its value, or with None the environment variable env (on unless it is "0")."""
    return bool(os.environ.get(env, "1") != "0" if flag is None else flag)


def _pdl_enabled(device) -> bool:
    if not _switch(USE_PDL, "PORTER_MOE_PDL") or os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_prefill_enabled(device) -> bool:
    """The FP8 prefill path needs fp8 MMA (SM89+); FP8_PREFILL / PORTER_MOE_FP8=0 turn it off."""
    if not _switch(FP8_PREFILL, "PORTER_MOE_FP8") or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fused_moe(p: PreparedMoE, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              routed_scaling_factor: float, cfg: MoeConfig | None = None, nosort: bool | None = None,
              fused_out: bool | None = None) -> torch.Tensor:
    """hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H] in hidden's dtype.

    Paths (launches): NOSORT for T*k <= NOSORT_MAX_SLOTS: [prescale], GEMM1, GEMM2 writing the
    output directly (fused output, one token; with more tokens prep also zeroes the fp32 output and a
    cast follows); else prep (align in kernel or torch, prescale or e4m3 quantize,
    zeroing), GEMM1, [FP8: act quantize], GEMM2 (atomics), cast. nosort / fused_out override the
    choice (tests, A/B); fused_out is honoured on the NOSORT path only (see below); cfg.fp8 runs
    the sorted path. (Both GEMMs of the one-token layer in one launch, GEMM2 tiles waiting on counters
    for their GEMM1 tiles, measured slower on the H200 - T=1 79.5-83.4 vs 70-71 us; as a persistent kernel
    71.6-72.4 vs 65.5-66.2 us - and was removed both times; docs/moe-backends.md.)"""
    from runtime.moe import triton_kernels as K
    t, h = hidden.shape
    k = topk_ids.shape[1]
    e = p.num_experts
    inter = p.w2.shape[2]
    n = t * k
    dev = hidden.device
    cfg = cfg or default_config(t, p.w_fp8 and fp8_prefill_enabled(dev))
    if cfg.fp8 and (h % FP8_BLOCK_K or inter % FP8_BLOCK_K or not p.fp8_weights_fit()):
        cfg = default_config(t, False)  # K % 128 == 0 for the rebased blocks, and room for them
    fp8 = cfg.fp8 > 0
    if fp8 and not p.w_fp8:
        raise ValueError("MoeConfig.fp8 needs MXFP8 weights (float8_e4m3fn + uint8 scales)")
    if nosort is None:
        nosort = n <= NOSORT_MAX_SLOTS
    nosort = nosort and n <= 64 and not fp8
    # Fused output by default only for one token (NOSORT: every program then holds one routed row).
    # On the sorted path (T = 64..256 at MiniMax-M3 dims, 10^4+ programs) the last arriver sometimes
    # read rows missing other programs' adds (rel 1e-2 vs the unfused path on H200, even with
    # per-thread gpu fences), and at T = 4 on the NOSORT path (programs holding rows of several
    # tokens) 8 of 200 calls at real dims were off by up to 5e-2
    # (benchmarks/results/gpu_tests_round4_call2.log); not understood yet. T = 1: 0 of 200 off.
    # Otherwise prep zeroing + atomics + cast. An explicit fused_out=True is honoured on the NOSORT path
    # (diagnosis).
    fused_out = (nosort and t == 1) if fused_out is None else fused_out
    fused_out = fused_out and nosort and t <= FUSED_OUT_MAX_TOKENS
    if nosort:
        cfg = replace(cfg, bm=max(16, next_pow2(n)))
    cfg = fit_config(cfg, h, inter)
    pdl = {"launch_pdl": True} if _pdl_enabled(dev) else {}
    hidden = hidden.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_w = topk_weights.reshape(-1).float().contiguous()  # [N]
    ep = next_pow2(e + 1)  # one spare histogram bin for padding lanes
    if nosort:  # one (mostly masked) BM block per routed slot; block m's expert is topk_ids[m]
        nblk, maxp = n, cfg.bm
        sorted_ids, expert_ids, cursor = topk_ids, topk_ids, topk_ids
        in_kernel_align = False
    else:
        nblk = max_blocks(n, e, cfg.bm)
        maxp = nblk * cfg.bm
        in_kernel_align = n <= ALIGN_IN_KERNEL_MAX_SLOTS
        if in_kernel_align:
            sorted_ids = torch.empty(maxp, dtype=torch.int32, device=dev)
            expert_ids = torch.empty(nblk, dtype=torch.int32, device=dev)
            cursor = torch.empty(ep, dtype=torch.int32, device=dev)
        else:
            sorted_ids, expert_ids = align_tokens(topk_ids, e, cfg.bm)
            cursor = sorted_ids
    if fused_out:
        scratch, out_counts = _fused_out_scratch(dev, h)
        out = scratch[: t * h].view(t, h)
        y = torch.empty((t, h), dtype=hidden.dtype, device=dev)
    else:
        out = torch.empty((t, h), dtype=torch.float32, device=dev)  # zeroed by prep, reduced by atomics
        y = out_counts = None
    # GEMM1's activation operand: [terms, T, H] e4m3 (FP8), [T, H] fp16 (W8A16 with guards) or hidden
    quant_x = 1 + cfg.fp8 if fp8 else int(p.fp16_1)  # _quant_row's QUANT
    if fp8:
        xq = torch.empty((cfg.fp8, t, h), dtype=torch.float8_e4m3fn, device=dev)
    else:
        xq = torch.empty((1, t, h), dtype=torch.float16, device=dev) if p.fp16_1 else hidden[None]
    xscale = torch.empty(t, dtype=torch.float32, device=dev)
    zero_out = not fused_out
    if in_kernel_align or quant_x or zero_out:
        K.prep_kernel[(t + int(in_kernel_align),)](
            hidden, xq, xq[-1], xscale, out, topk_ids, sorted_ids, expert_ids, cursor,
            t, h, n, e, nblk, hidden.stride(0),
            DO_ALIGN=in_kernel_align, QUANT=quant_x, ZERO_OUT=zero_out, HP=next_pow2(h),
            BM=cfg.bm, EP=ep, C=64, CB=128, num_warps=8)
    if fp8:
        w13, s13, w2, s2 = p.fp8_weights(FP8_ROW_SCALE)
        wmode1 = wmode2 = 5 if p.fp8_row_scale else 4  # 5: one weight scale per row
    else:
        wmode1, wmode2 = p.wmode1, p.wmode2
        w13, s13, w2, s2 = p.w13, p.w13_scale, p.w2, p.w2_scale
    ss13 = (s13.stride(0), s13.stride(1)) if p.w_fp8 else (0, 0)
    ss2 = (s2.stride(0), s2.stride(1)) if p.w_fp8 else (0, 0)
    # act rows in sorted (or slot) order; bf16 before the FP8 path's quantize kernel
    act_dtype = torch.float16 if p.fp16_2 and not fp8 else torch.bfloat16
    act = torch.empty((maxp, inter), dtype=act_dtype, device=dev)
    n1 = inter // cfg.bn1
    K.gemm1_swiglu_kernel[(nblk * n1,)](
        xq, t * h, xscale, w13, s13, p.shift13, p.epi13, p.alpha, p.beta, p.limit,
        sorted_ids, expert_ids, act, n, h, inter, e, n1,
        xq.stride(1), w13.stride(0), w13.stride(1), *ss13,
        TOPK=k, WMODE=wmode1, PRESCALED=quant_x > 0, TERMS=cfg.fp8, SWAP=cfg.swap1 and not fp8,
        BM=cfg.bm, BN=cfg.bn1, BK=cfg.bk1, NOSORT=nosort, USE_PDL=bool(pdl),
        num_warps=cfg.warps1, num_stages=cfg.stages1, **pdl)
    if fp8:  # act -> [terms, MAXP, I] e4m3 + per-row 2^m
        aq = torch.empty((cfg.fp8, maxp, inter), dtype=torch.float8_e4m3fn, device=dev)
        ascale = torch.empty(maxp, dtype=torch.float32, device=dev)
        K.quant_rows_kernel[(maxp,)](act, aq, aq[-1], ascale, sorted_ids, n, inter,
                                     QUANT=1 + cfg.fp8, DP=next_pow2(inter), USE_PDL=bool(pdl),
                                     num_warps=8, **pdl)
        act = aq
    else:
        act, ascale = act[None], xscale
    n2 = h // cfg.bn2
    K.gemm2_reduce_kernel[(nblk * n2,)](
        act, maxp * inter, ascale, w2, s2, p.shift2, p.epi2, topk_w, out, sorted_ids, expert_ids,
        n, inter, h, e, float(routed_scaling_factor), n2,
        w2.stride(0), w2.stride(1), *ss2,
        TOPK=k, WMODE=wmode2, TERMS=cfg.fp8, SWAP=cfg.swap2 and not fp8,
        BM=cfg.bm, BN=cfg.bn2, BK=cfg.bk2, y_ptr=y if fused_out else out,
        count_ptr=out_counts if fused_out else out, NOSORT=nosort, FUSED_OUT=fused_out, USE_PDL=bool(pdl),
        num_warps=cfg.warps2, num_stages=cfg.stages2, **pdl)
    return y if fused_out else out.to(hidden.dtype)


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The in-kernel alignment alone (prep program 0); same outputs as align_tokens (tests)."""
    from runtime.moe import triton_kernels as K
    n = topk_ids.numel()
    nblk = max_blocks(n, num_experts, block_m)
    ep = next_pow2(num_experts + 1)
    dev = topk_ids.device
    sorted_ids = torch.empty(nblk * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nblk, dtype=torch.int32, device=dev)
    cursor = torch.empty(ep, dtype=torch.int32, device=dev)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    K.prep_kernel[(1,)](dummy, dummy, dummy, dummy, dummy, topk_ids.contiguous(), sorted_ids, expert_ids, cursor,
                        0, 1, n, num_experts, nblk, 1, DO_ALIGN=True, QUANT=0, ZERO_OUT=False, HP=16,
                        BM=block_m, EP=ep, C=64, CB=128, num_warps=8)
    return sorted_ids, expert_ids


class TritonMoE:
    name = "triton"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable(f"triton MoE backend needs a CUDA device with capability >= 8.0 "
                                     f"(SM80+); got device type {device.type!r}")
        if not torch.cuda.is_available():
            raise BackendUnavailable("triton MoE backend needs CUDA (capability >= 8.0), but "
                                     "torch.cuda.is_available() is False")
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            raise BackendUnavailable(f"triton MoE backend needs compute capability >= 8.0 (SM80+); "
                                     f"{torch.cuda.get_device_name(device)} is SM{cap[0]}{cap[1]}")
        import importlib.util
        if importlib.util.find_spec("triton") is None:
            raise BackendUnavailable("triton MoE backend needs the 'triton' package (capability "
                                     f"SM{cap[0]}{cap[1]} is fine); pip install triton")

    def __init__(self, quant: MoeQuantInfo, routing: MoeRouting):
        quant.validate()
        if not quant.is_mxfp8:
            raise BackendUnavailable("triton MoE backend runs MXFP8 weights only (float8_e4m3fn + uint8 "
                                     "UE8M0 scales); these weights are unquantized: use backend='torch'")
        self.check_supported(quant.w13_weight.device)
        self.routing = routing
        self.prepared = prepare(quant.w13_weight, quant.w13_weight_scale, quant.w2_weight,
                                quant.w2_weight_scale, quant.gemm1_alpha, quant.gemm1_beta,
                                quant.gemm1_clamp_limit)
        # Rebased at load, the backend holds its own copy of the experts: it keeps no reference to the
        # MXFP8 tensors (quant None), so a caller that drops its own has each layer's experts resident once.
        self.quant = None if self.prepared.rebased else quant

    @property
    def replaced_weights(self) -> bool:
        """Whether the backend's layout replaced the canonical tensors (rebased at load)."""
        return self.prepared.rebased

    def forward_topk(self, hidden_states, topk_ids, topk_weights, config: MoeConfig | None = None):
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] (renormalised) -> routed output [T, H],
        routed_scaling_factor applied once (in GEMM2's epilogue)."""
        if hidden_states.shape[0] == 0:
            return torch.zeros_like(hidden_states)
        return fused_moe(self.prepared, hidden_states, topk_ids, topk_weights,
                         self.routing.routed_scaling_factor, config)

    def __call__(self, hidden_states):
        topk_ids, topk_weights = route(hidden_states, self.routing)
        return self.forward_topk(hidden_states, topk_ids, topk_weights)
