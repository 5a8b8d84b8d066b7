"""Tile tables and named kernel modes of the Triton MoE (measurements behind them: docs/moe-backends.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum


class WMode(IntEnum):
    """How GEMM1/GEMM2 read their weights (the kernels' WMODE constexpr; runtime/moe/triton/kernels.py)."""

    BF16_WEIGHTS = 0  # 16-bit weights as stored, no scales (the benchmark's baseline)
    FP16 = 1  # e4m3 * fp16(2^(s-127)): every scale byte in the fp16-exact window
    FP16_OFFSET = 2  # FP16 with a per-expert power-of-two offset folded out of the bytes
    BF16 = 3  # the scale bytes span more than fp16's exact window: dequantize to bf16
    FP8_BLOCKS = 4  # FP8 MMA on weights rebased to one scale per (row, 128 K)
    FP8_ROWS = 5  # FP8 MMA on weights rebased to one scale per row
    FP8_ROWS_PROMOTED = 6  # FP8_ROWS with each 128-K partial added in fp32 (the serving numerics)
    REBASED = 7  # fp16 MMA on weights rebased at load to one scale per row


class Quant(IntEnum):
    """How the prep / act kernels store an MMA activation operand (the kernels' QUANT constexpr)."""

    NONE = 0  # as given (bf16 GEMM)
    FP16 = 1  # fp16 with a per-token power-of-two scale
    E4M3 = 2  # one e4m3 term with a per-token power-of-two scale
    E4M3_TWO_TERMS = 3  # hi + lo e4m3 terms
    BF16 = 4  # bf16 as given, scale 1 (rows already rounded to MXFP8 values; the serving numerics)

    @classmethod
    def e4m3(cls, terms: int) -> "Quant":
        return cls(cls.E4M3 + terms - 1)


FP8_PREFILL_MIN_TOKENS = 512  # the FP8 prefill path from here on (the H200 crossover), W8A16 below
FP8_TERMS = 2  # e4m3 terms per activation: one term misses the 2e-2 layer error bound
FP8_BLOCK_K = 128  # the FP8 path's K step, and the K extent of one rebased weight scale
FP8_ROW_SCALE = True  # FP8 path: one rebased weight scale per row (faster) rather than per 128 K
ALIGN_IN_KERNEL_MAX_SLOTS = 1024  # above this the torch sort is cheaper than one-program alignment
# T up to here: no alignment, one block per routed slot whose BM = 16 rows are the tokens, so top_k does not
# widen it (top-8 at T=4: 32 slots in BM 16; as slots they took BM 32, 13 % slower than the sorted path on the
# H200); above, the sorted path, measured the faster at T=8 at both measured layer shapes (docs/moe-backends.md).
NOSORT_MAX_TOKENS = 4
NOSORT_PREFETCH_BYTES = 512  # NOSORT, serving numerics: bytes per weight row GEMM1 prefetches during prep
FUSED_OUT_MAX_TOKENS = 256  # fused-output path up to here: persistent fp32 scratch of T x H


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


def default_config(num_tokens: int, fp8_prefill: bool = False) -> MoeConfig:
    """The H200-tuned tiles for T tokens (docs/moe-backends.md, tile choice). Decode: BM16 with one fused
    [gate; up] tile of 2 x 32 rows, BK 256, 4 warps; BM grows with T so each weight tile streams about once
    per expert; fp8_prefill: the FP8 path from FP8_PREFILL_MIN_TOKENS on."""
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
        return replace(
            cfg, bn1=div(cfg.bn1, inter), bk1=FP8_BLOCK_K, bn2=div(cfg.bn2, hidden), bk2=FP8_BLOCK_K
        )
    return replace(
        cfg,
        bn1=div(cfg.bn1, inter),
        bk1=div(cfg.bk1, hidden),
        bn2=div(cfg.bn2, hidden),
        bk2=div(cfg.bk2, inter),
    )


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case BM blocks after padding each used expert to BM (grid size without a host sync)."""
    return (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m
