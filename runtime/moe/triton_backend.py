"""Hopper (SM90; runs on SM80+) MoE backend: Triton MXFP8 fused MoE reading the canonical tensors.

Kernels and the fp16 range-guard rules are in runtime/moe/triton_kernels.py. This module holds the
load-time guard computation (per-expert power-of-two offsets; no weight copy in any other format),
token alignment, launch-config choice and the TritonMoE class with TorchMoE's interface.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from runtime.moe.contract import MoeQuantInfo, MoeRouting, route

FP16_EXACT_BYTES = (112, 134)  # e8m0 bytes for which fp16(e4m3) * fp16(2^(s-127)) is exact
ACT_FP16_MAX_LOG2 = 15  # keep fp16 MMA operands below 2^15 (fp16 max is 65504)
ALIGN_IN_KERNEL_MAX_SLOTS = 1024  # above this the torch sort is cheaper than one-program align


@dataclass(frozen=True)
class MoeConfig:
    """Tile shapes. GEMM1 tiles are BN1 gate + BN1 up rows of w13; GEMM2 tiles BN2 rows of w2."""
    bm: int
    bn1: int
    bk1: int
    split1: int
    warps1: int
    stages1: int
    bn2: int
    bk2: int
    split2: int
    warps2: int
    stages2: int
    fused1: bool = False  # GEMM1: one [2*BN1, BK1] gate+up tile and one MMA per step
    swap1: bool = False  # weight as the left MMA operand (prefill, BM >= 64)
    swap2: bool = False


def default_config(num_tokens: int) -> MoeConfig:
    """Tile configs from the H200 A/B (benchmarks/moe_ab_h200.py; benchmarks/results/bench_ab.log).

    Decode (BM16): the doc's BN64/BK256/4 warps shape; GEMM1 as one fused [gate; up] tile of
    2 x 32 rows. Split-K no longer pays once the dequant is hoisted (T=1: 85 us unsplit vs 92 us
    split 2). 4 stages for 5..128 tokens, 3 elsewhere. BM32 at <= 1024 tokens (~32 rows per
    expert: every weight tile streamed once). Prefill: wgmma tiles, BM128 from 2048 tokens (T=4096:
    8.90 ms vs 9.67 ms for BM64), GEMM1 as one fused [gate; up] 128-row tile (T=4096: GEMM1 5.17 ms
    vs 6.05 ms for two 64-row tiles; whole layer 8.05 vs 8.89 ms). T <= 4 runs the NOSORT path
    (fused_moe), which forces BM = 16."""
    if num_tokens <= 4:
        return MoeConfig(16, 32, 256, 1, 4, 3, 64, 256, 1, 4, 3, True)
    if num_tokens <= 128:
        return MoeConfig(16, 32, 256, 1, 4, 4, 64, 256, 1, 4, 4, True)
    if num_tokens <= 512:
        return MoeConfig(16, 32, 256, 1, 4, 3, 64, 256, 1, 4, 3, True)
    if num_tokens <= 1024:
        return MoeConfig(32, 32, 256, 1, 4, 3, 64, 256, 1, 4, 3, True)
    if num_tokens < 2048:
        return MoeConfig(64, 64, 128, 1, 8, 3, 128, 64, 1, 4, 4)
    return MoeConfig(128, 64, 128, 1, 8, 3, 128, 128, 1, 8, 3, True)


def fit_config(cfg: MoeConfig, hidden: int, inter: int) -> MoeConfig:
    """Shrink tiles so BN divides N and BK * split divides K (no masks in the weight stream)."""
    def bn(b, n):  # n is a multiple of 32 (MXFP8), so this stops at >= 32 for b >= 32
        while n % b:
            b //= 2
        return b

    def bk_split(bk, split, k):
        while split > 1 and (k // 32) % split:
            split -= 1
        while (k // split) % bk:
            bk //= 2
        return bk, split

    bk1, s1 = bk_split(cfg.bk1, cfg.split1, hidden)
    bk2, s2 = bk_split(cfg.bk2, cfg.split2, inter)
    return replace(cfg, bn1=bn(cfg.bn1, inter), bk1=bk1, split1=s1, bn2=bn(cfg.bn2, hidden), bk2=bk2, split2=s2)


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
    """Device tensors the kernels read; the weights are the caller's tensors, never copied."""
    w13: torch.Tensor  # [E, 2I, H] float8_e4m3fn (or bf16 for the benchmark baseline)
    w13_scale: torch.Tensor  # [E, 2I, H/32] uint8 (dummy for bf16)
    w2: torch.Tensor  # [E, H, I]
    w2_scale: torch.Tensor  # [E, H, I/32] uint8
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

    @staticmethod
    def _wmode(w_fp8: bool, fp16: bool, shift: torch.Tensor) -> int:
        """The kernels' WMODE: 0 16-bit weights, 1 fp16 (no offset, fast), 2 fp16 + per-expert
        offset, 3 bf16 fallback."""
        if not w_fp8:
            return 0
        if not fp16:
            return 3
        return 2 if bool(shift.ne(0).any()) else 1

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def prepare(w13, w13_scale, w2, w2_scale, alpha, beta, limit) -> PreparedMoE:
    """Load-time guard analysis: reads the scales once, keeps references to the stored tensors."""
    dev, e = w13.device, w13.shape[0]
    w_fp8 = w13_scale is not None
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


_counters: dict = {}
_out_scratch: dict = {}
FUSED_OUT_MAX_TOKENS = 256  # fused-output path up to here: persistent fp32 scratch of T x H
NOSORT_MAX_SLOTS = 16  # T * top_k up to here: no alignment, one block per routed slot (BM 16)
USE_PDL = None  # programmatic dependent launch of the GEMMs (SM90+); None: PORTER_MOE_PDL env, default on


def _split_counters(device, n: int) -> torch.Tensor:
    """Zeroed per-tile arrival counters for GEMM1 split-K; the last arriver re-zeroes its own."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def _fused_out_scratch(device, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Persistent zeroed fp32 [FUSED_OUT_MAX_TOKENS, H] accumulator and per (token, 16-column tile)
    arrival counters of the fused-output GEMM2 (kept zeroed by the kernel's last arrivers).
    Allocated once per (device, H) at full size and never freed or grown, so CUDA graphs captured
    with these pointers stay valid. Memory: 1024 * H * 4 B (25 MB at H = 6144) + 1024 * H / 4 B."""
    key = (str(device), hidden)
    buf = _out_scratch.get(key)
    if buf is None:
        buf = (torch.zeros(FUSED_OUT_MAX_TOKENS * hidden, dtype=torch.float32, device=device),
               torch.zeros(FUSED_OUT_MAX_TOKENS * ((hidden + 15) // 16), dtype=torch.int32, device=device))
        _out_scratch[key] = buf
    return buf


def _pdl_enabled(device) -> bool:
    import os
    flag = USE_PDL
    if flag is None:
        flag = os.environ.get("PORTER_MOE_PDL", "1") != "0"
    if not flag or os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def fused_moe(p: PreparedMoE, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              routed_scaling_factor: float, cfg: MoeConfig | None = None, nosort: bool | None = None,
              fused_out: bool | None = None) -> torch.Tensor:
    """hidden [T, H], topk_ids [T, k], topk_weights [T, k] -> [T, H] in hidden's dtype.

    Paths (launches): NOSORT for T*k <= NOSORT_MAX_SLOTS: [prescale], GEMM1, GEMM2 writing the
    output directly (fused output); else prep (align in kernel or torch, prescale, zeroing), GEMM1,
    GEMM2 (atomics), cast. nosort / fused_out override the choice (tests, A/B); fused_out is
    honoured on the NOSORT path only (see below)."""
    from runtime.moe import triton_kernels as K
    t, h = hidden.shape
    k = topk_ids.shape[1]
    e = p.num_experts
    inter = p.w2.shape[2]
    n = t * k
    if nosort is None:
        nosort = n <= NOSORT_MAX_SLOTS
    nosort = nosort and n <= 64
    # Fused output only on the NOSORT path. On the sorted path (T = 64..256 at MiniMax-M3 dims,
    # 10^4+ programs) the last arriver sometimes read rows missing other programs' adds (rel 1e-2
    # vs the unfused path on H200, even with per-thread gpu fences); not understood yet, so the
    # sorted path keeps prep zeroing + atomics + cast. NOSORT: max diff 3e-6 over 8 calls each at
    # T = 1, 4 (fp32 atomic order).
    fused_out = nosort if fused_out is None else fused_out
    fused_out = fused_out and nosort and t <= FUSED_OUT_MAX_TOKENS
    cfg = cfg or default_config(t)
    if nosort:
        cfg = replace(cfg, bm=max(16, triton_next_pow2(n)))
    cfg = fit_config(cfg, h, inter)
    dev = hidden.device
    pdl = {"launch_pdl": True} if _pdl_enabled(dev) else {}
    hidden = hidden.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_w = topk_weights.reshape(-1).float().contiguous()  # [N]
    ep = triton_next_pow2(e + 1)  # one spare histogram bin for padding lanes
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
    x16 = torch.empty((t, h), dtype=torch.float16, device=dev) if p.fp16_1 else hidden
    xscale = torch.empty(t, dtype=torch.float32, device=dev)
    zero_out = not fused_out
    if in_kernel_align or p.fp16_1 or zero_out:
        K.prep_kernel[(t + int(in_kernel_align),)](
            hidden, x16, xscale, out, topk_ids, sorted_ids, expert_ids, cursor,
            t, h, n, e, nblk, hidden.stride(0),
            DO_ALIGN=in_kernel_align, PRESCALE=p.fp16_1, ZERO_OUT=zero_out, HP=triton_next_pow2(h),
            BM=cfg.bm, EP=ep, C=64, CB=128, num_warps=8)
    pdl1 = pdl  # each GEMM waits (griddepcontrol.wait) for the previous kernel before any access
    act_dtype = torch.float16 if p.fp16_2 else torch.bfloat16
    act = torch.empty((maxp, inter), dtype=act_dtype, device=dev)  # rows in sorted (or slot) order
    n1 = inter // cfg.bn1
    if cfg.split1 > 1:
        part = torch.empty((cfg.split1, maxp, 2 * inter), dtype=torch.float32, device=dev)
        counts = _split_counters(dev, nblk * n1)
    else:
        part = counts = act
    K.gemm1_swiglu_kernel[(nblk * n1 * cfg.split1,)](
        x16, xscale, p.w13, p.w13_scale, p.shift13, p.epi13, p.alpha, p.beta, p.limit,
        sorted_ids, expert_ids, act, part, counts, n, h, inter, e, maxp, n1,
        x16.stride(0), p.w13.stride(0), p.w13.stride(1), p.w13_scale.stride(0) if p.w_fp8 else 0,
        p.w13_scale.stride(1) if p.w_fp8 else 0,
        TOPK=k, WMODE=p.wmode1, PRESCALED=p.fp16_1, FUSED_GU=cfg.fused1, SWAP=cfg.swap1, SPLIT_K=cfg.split1,
        BM=cfg.bm, BN=cfg.bn1, BK=cfg.bk1, NOSORT=nosort, USE_PDL=bool(pdl1),
        num_warps=cfg.warps1, num_stages=cfg.stages1, **pdl1)
    n2 = h // cfg.bn2
    K.gemm2_reduce_kernel[(nblk * n2 * cfg.split2,)](
        act, p.w2, p.w2_scale, p.shift2, p.epi2, topk_w, out, sorted_ids, expert_ids,
        n, inter, h, e, float(routed_scaling_factor), n2,
        p.w2.stride(0), p.w2.stride(1), p.w2_scale.stride(0) if p.w_fp8 else 0,
        p.w2_scale.stride(1) if p.w_fp8 else 0,
        TOPK=k, WMODE=p.wmode2, SWAP=cfg.swap2, SPLIT_K=cfg.split2,
        BM=cfg.bm, BN=cfg.bn2, BK=cfg.bk2, y_ptr=y if fused_out else out,
        count_ptr=out_counts if fused_out else out, NOSORT=nosort, FUSED_OUT=fused_out, USE_PDL=bool(pdl),
        num_warps=cfg.warps2, num_stages=cfg.stages2, **pdl)
    return y if fused_out else out.to(hidden.dtype)


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The in-kernel alignment alone (prep program 0); same outputs as align_tokens (tests)."""
    from runtime.moe import triton_kernels as K
    n = topk_ids.numel()
    nblk = max_blocks(n, num_experts, block_m)
    ep = triton_next_pow2(num_experts + 1)
    dev = topk_ids.device
    sorted_ids = torch.empty(nblk * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nblk, dtype=torch.int32, device=dev)
    cursor = torch.empty(ep, dtype=torch.int32, device=dev)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    K.prep_kernel[(1,)](dummy, dummy, dummy, dummy, topk_ids.contiguous(), sorted_ids, expert_ids, cursor,
                        0, 1, n, num_experts, nblk, 1, DO_ALIGN=True, PRESCALE=False, ZERO_OUT=False, HP=16,
                        BM=block_m, EP=ep, C=64, CB=128, num_warps=8)
    return sorted_ids, expert_ids


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


class TritonMoE:
    name = "triton"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        from runtime.moe import BackendUnavailable  # lazy: runtime.moe imports this module
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
            raise ValueError("triton MoE backend runs MXFP8 weights only (float8_e4m3fn + uint8 "
                             "UE8M0 scales); these weights are unquantized: use backend='torch'")
        self.check_supported(quant.w13_weight.device)
        self.quant, self.routing = quant, routing
        self.prepared = prepare(quant.w13_weight, quant.w13_weight_scale, quant.w2_weight,
                                quant.w2_weight_scale, quant.gemm1_alpha, quant.gemm1_beta,
                                quant.gemm1_clamp_limit)

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
