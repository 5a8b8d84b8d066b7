"""Load-time weight preparation of the Triton MoE: the fp16 range guards (per-expert power-of-two offsets)
and the rebase to one power-of-two scale per row that replaces the MXFP8 tensors where it is exact enough.
Why each guard exists: the docstring of runtime/moe/triton/kernels.py; measurements: docs/moe-backends.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from porter.format import mxfp8
from runtime.moe.triton.config import FP8_BLOCK_K, WMode

log = logging.getLogger("porter.runtime")

FP16_EXACT_BYTES = (112, 134)  # e8m0 bytes for which fp16(e4m3) * fp16(2^(s-127)) is exact
ACT_FP16_MAX_LOG2 = 15  # keep fp16 MMA operands below 2^15 (fp16 max is 65504)
REBASE_MARGIN = 1.1  # free device memory the load-time rebase asks for, times its own bytes (rebase_fits)
FP8_COPY_MARGIN = 1.25  # the same for the FP8 path's copy of weights kept as stored (fp8_weights_fit)
_FP8_NO_ROOM_WARNED: list = []  # warn once per process
_REBASE_NO_ROOM_WARNED: list = []


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


def rebase_fp8(
    q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK_K
) -> tuple[torch.Tensor, torch.Tensor]:
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
    (0.2785 = max over g < 0 of |g sigmoid(g)|): then act can be stored in fp16 for GEMM2 as it is.
    A larger bound (or alpha <= 0, limit = inf: plain SwiGLU) needs act_bounds' per-row scale instead."""
    a, b, lim = alpha.double().cpu(), beta.double().cpu(), limit.double().abs().cpu()
    if not bool((a > 0).all()):
        return False
    bound = torch.maximum(lim, 0.2785 / a) * (lim + b.abs())
    return bool((bound < 2.0**ACT_FP16_MAX_LOG2).all())


def act_bounds(
    w13: torch.Tensor, w13_scale: torch.Tensor, bias: Optional[torch.Tensor], rebased: bool
) -> torch.Tensor:
    """fp32 [E, 4] per expert: (largest L1 norm of a gate row, largest |gate bias|, the same for the up
    rows), of the weights GEMM1 multiplies (rebased: e4m3 times its row scale; else the MXFP8 values).

    With them the kernels bound each routed row's SwiGLU-OAI output when the config alone does not
    (act_fp16_ok false, e.g. plain SwiGLU): a token whose prep-scaled row has |x| < 2^15 * xs has
    |gate| <= 2^15 xs * G + Gb and |up| <= 2^15 xs * U + Ub (Hoelder), so |act| <= min(that, max(|L|,
    0.2785/alpha)) * (min(that, |L|) + |beta|); act is stored in fp16 times the power of two that puts this
    bound below 2^15 and GEMM2 multiplies it back (kernels._act_shift). One expert at a time."""
    e, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.zeros((e, 4), dtype=torch.float32, device=w13.device)
    for i in range(e):
        if rebased:
            l1 = w13[i].float().abs().sum(-1) * w13_scale[i, :, 0]  # [2I]
        else:
            l1 = mxfp8.dequantize(w13[i], w13_scale[i], torch.float32).abs().sum(-1)  # [2I]
        out[i, 0], out[i, 2] = l1[:inter].max(), l1[inter:].max()
        if bias is not None:
            out[i, 1], out[i, 3] = bias[i, :inter].abs().max(), bias[i, inter:].abs().max()
    return out


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
    w13_bias: Optional[torch.Tensor] = None  # [E, 2I] fp32 ([gate; up]), added before SwiGLU-OAI
    w2_bias: Optional[torch.Tensor] = None  # [E, H] fp32, added before the routing weight
    act_bound: Optional[torch.Tensor] = None  # [E, 4] fp32 (act_bounds): act stored scaled per row, else None
    wmode1: WMode = WMode.FP16  # how GEMM1 / GEMM2 read the weights (see _wmode)
    wmode2: WMode = WMode.FP16
    fp8_blocks: Optional[tuple] = None  # the FP8 path's rebased weights, made on first use (fp8_weights)
    fp8_row_scale: bool = False  # whether fp8_blocks has one scale per row or per (row, 128 K)
    fp8_requested: Optional[bool] = None  # the row_scale fp8_blocks was made for
    rebased: bool = False  # w13 / w2 are the load-time rebase (WMode.REBASED), not the MXFP8 tensors

    def fp8_weights(self, row_scale: bool) -> tuple:
        """(w13 e4m3 [E, 2I, H], s13 fp32 [E, 2I, H/128], w2 e4m3 [E, H, I], s2 fp32 [E, H, I/128]):
        the weights rebased to one power-of-two scale per (row, 128 K), or with row_scale per row (s13
        [E, 2I, 1], s2 [E, H, 1]) where row_scale_ok holds for both (else per 128 K; fp8_row_scale says
        which). A layer rebased at load returns its own tensors (one scale per row, whatever row_scale
        asks: the MXFP8 bytes per 128 K are gone). Otherwise the copy is made once per layer on the first
        FP8 prefill call: a second copy of the experts in e4m3 (1 B per weight + 1/32 B of scales: 7.5 GB
        per MiniMax-M3 layer); TritonMoE(fp8_prefill=False) avoids it."""
        if self.rebased:
            self.fp8_row_scale = True
            return self.w13, self.w13_scale, self.w2, self.w2_scale
        if self.fp8_blocks is None or self.fp8_requested != row_scale:
            self.fp8_blocks = None  # switching row_scale frees the other copy first
            rows = row_scale and row_scale_ok(self.w13_scale) and row_scale_ok(self.w2_scale)
            if row_scale and not rows:
                log.info(
                    "FP8 prefill: a weight row spans more than %d octaves of MXFP8 scales; this layer "
                    "keeps one scale per 128 K",
                    ROW_SCALE_MAX_OCTAVES,
                )
            b13 = self.w13.shape[2] if rows else FP8_BLOCK_K
            b2 = self.w2.shape[2] if rows else FP8_BLOCK_K
            self.fp8_blocks = (
                *rebase_fp8(self.w13, self.w13_scale, b13),
                *rebase_fp8(self.w2, self.w2_scale, b2),
            )
            self.fp8_row_scale, self.fp8_requested = rows, row_scale
        return self.fp8_blocks

    def fp8_weights_fit(self) -> bool:
        """Whether the rebased copy (fp8_weights) exists or fits in the device's free memory with
        FP8_COPY_MARGIN (has_room). A fully resident model leaves no room for a second copy of every
        layer's experts; then prefill stays on the W8A16 path instead of dying with an out-of-memory error."""
        if self.fp8_blocks is not None or self.rebased:
            return True
        need = (self.w13.numel() + self.w2.numel()) * (1 + 4 / FP8_BLOCK_K)  # e4m3 + fp32 per 128
        return has_room(
            self.w13.device,
            need,
            FP8_COPY_MARGIN,
            _FP8_NO_ROOM_WARNED,
            "FP8 prefill path off: its rebased expert copy needs %.1f GB per layer, %.1f GB "
            "free; prefill runs on the W8A16 path (same results, slower)",
        )

    @staticmethod
    def _wmode(w_fp8: bool, fp16: bool, shift: torch.Tensor) -> WMode:
        """The stored layout's mode (REBASED and the FP8 modes are chosen by prepare / per call)."""
        if not w_fp8:
            return WMode.BF16_WEIGHTS
        if not fp16:
            return WMode.BF16
        return WMode.FP16_OFFSET if bool(shift.ne(0).any()) else WMode.FP16

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


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
    of memory at load. Without room the layer keeps the stored layout (same results, slower decode)."""
    return has_room(
        w13.device,
        rebase_bytes(w13, w2),
        REBASE_MARGIN,
        _REBASE_NO_ROOM_WARNED,
        f"MoE experts kept as stored on {w13.device}: rebasing a layer at load needs %.1f GB free "
        "for a moment, %.1f GB are; decode runs on the stored layout (same results, slower)",
    )


def prepare(
    w13, w13_scale, w2, w2_scale, alpha, beta, limit, w13_bias=None, w2_bias=None, rebase: bool = True
) -> PreparedMoE:
    """Load-time guard analysis: reads the scales once. MXFP8 weights whose rows each span at most
    ROW_SCALE_MAX_OCTAVES of scales (row_scale_ok) are rebased to one power-of-two scale per row (rebase;
    against the MXFP8 values rel error <= 1e-5) and the result replaces them: the weight stream then
    converts e4m3 -> fp16 with no per-32 scale multiply (WMode.REBASED) and the FP8 path reads the same
    tensors, where the device has room for both copies for a moment (rebase_fits). Otherwise (or
    rebase=False) it keeps references to the stored tensors. GEMM2 reads act in fp16: as it is where the
    SwiGLU-OAI parameters bound it (act_fp16_ok), else scaled per row by act_bounds' bound (GEMM1 in fp16
    only; with GEMM1 in bf16, act stays bf16 and GEMM2 runs in bf16). Biases (fp32) are kept as given."""
    dev, e = w13.device, w13.shape[0]
    w_fp8 = w13_scale is not None
    act_ok = act_fp16_ok(alpha, beta, limit)
    biases = dict(w13_bias=w13_bias, w2_bias=w2_bias)
    if w_fp8 and rebase and row_scale_ok(w13_scale) and row_scale_ok(w2_scale) and rebase_fits(w13, w2):
        w13, s13 = rebase_fp8(w13, w13_scale, w13.shape[2])  # [E, 2I, H] e4m3, [E, 2I, 1] fp32
        w2, s2 = rebase_fp8(w2, w2_scale, w2.shape[2])
        zero, one = (
            torch.zeros(e, dtype=torch.int32, device=dev),
            torch.ones(e, dtype=torch.float32, device=dev),
        )
        return PreparedMoE(
            w13,
            s13,
            w2,
            s2,
            alpha,
            beta,
            limit,
            True,
            True,
            True,
            zero,
            zero,
            one,
            one,
            **biases,
            act_bound=None if act_ok else act_bounds(w13, s13, w13_bias, rebased=True),
            wmode1=WMode.REBASED,
            wmode2=WMode.REBASED,
            fp8_row_scale=True,
            rebased=True,
        )
    if w_fp8:
        d13, ok13 = weight_shifts(w13_scale)
        d2, ok2 = weight_shifts(w2_scale)
    else:
        d13, ok13 = torch.zeros(e, dtype=torch.int32), False
        d2, ok2 = torch.zeros(e, dtype=torch.int32), False
        w13_scale = w2_scale = torch.zeros(1, dtype=torch.uint8, device=dev)
    scaled = w_fp8 and ok13 and not act_ok  # act scaled per row needs GEMM1's fp16 prescaled tokens
    ok2 = ok2 and (act_ok or scaled)
    d13 = d13 if ok13 else torch.zeros_like(d13)  # the bf16 path decodes the raw bytes
    d2 = d2 if ok2 else torch.zeros_like(d2)
    pow2 = lambda t: torch.ldexp(torch.ones(e, dtype=torch.float32), t.float()).to(dev)
    return PreparedMoE(
        w13,
        w13_scale,
        w2,
        w2_scale,
        alpha,
        beta,
        limit,
        w_fp8,
        ok13,
        ok2,
        d13.to(dev),
        d2.to(dev),
        pow2(d13),
        pow2(d2),
        **biases,
        act_bound=act_bounds(w13, w13_scale, w13_bias, rebased=False) if scaled and ok2 else None,
        wmode1=PreparedMoE._wmode(w_fp8, ok13, d13),
        wmode2=PreparedMoE._wmode(w_fp8, ok2, d2),
    )
