"""MXFP4 (OCP MX v1.0, E2M1 elements, UE8M0 scales, blocks of 32 along K) as checkpoints store it, and its
exact conversion to MXFP8 (porter.format.mxfp8). Architecture-free; the rules are in docs/mxfp8.md.

Storage (the layout of OpenAI's MXFP4 open-weight releases, as transformers' `integrations/mxfp4.py` reads it):
- `X_blocks` uint8 [..., N, K/32, 16]: 16 bytes per block of 32 values, two E2M1 codes per byte, the
  **low nibble first** (element 2j = byte j & 0xF, element 2j + 1 = byte j >> 4);
- `X_scales` uint8 [..., N, K/32]: one UE8M0 byte s per block, value 2^(s - 127) (255 is NaN);
- value = e2m1(code) * 2^(s - 127), codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and 8..15 their negatives.

MXFP4 -> MXFP8 keeps each block's scale byte and widens each E2M1 code to the E4M3 code of the same value.
That is exact for every code and every scale byte: every E2M1 magnitude is 0 or m * 2^e with m in {1, 1.5}
and e in [-1, 2], a normal E4M3 number (3 mantissa bits, exponents -6..8), and the scale is the same UE8M0
byte, so an MXFP8 block dequantizes to the MXFP4 block's values bit for bit (tests/test_mxfp4.py checks all
16 codes under all 255 scale bytes). The scale byte is never re-derived: rceil on the dequantized block
would pick a byte up to 6 lower (its largest value 6 * 2^6 = 384 <= 448) — also exact, other bytes; keeping
it makes the artifact a function of the release's bytes alone, the rule porter applies to MXFP8 sources
too (porter.format.prequantized, "kept-rows").

What is refused, naming the tensor and the block (never rounded, never written):
- scale byte 255 (E8M0 NaN);
- scale byte 0 (2^-127) on a block with a non-zero value: porter's rule for MXFP8 is that byte 0 encodes
  only all-zero blocks (a zeroed scale silently zeroes weights), and the kept byte would break it;
- a value of 2^128 or more (|code value| >= 2 at byte 254, >= 4 at byte 253): exact in MXFP8 as well, but
  no bfloat16 / float32 holds it, and porter's conversion carries dequantized values in bfloat16 (so does
  transformers' dequantization, where such a weight becomes inf). Every other value, down to 0.5 * 2^-127,
  is exact in bfloat16 (a subnormal below 2^-126).
"""

from __future__ import annotations

from typing import Optional

import torch

from porter.errors import PrequantizedError
from porter.format import mxfp8

BLOCK = mxfp8.BLOCK  # values per scale byte
BLOCK_BYTES = BLOCK // 2  # bytes of packed codes per block
SCALE_NAN_BYTE = mxfp8.SCALE_NAN_BYTE
# E2M1 code -> value (sign bit 3, two exponent bits with bias 1, one mantissa bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# E2M1 code -> the E4M3 code of the same value (-0.0 -> 0x80): exact, every value is a normal E4M3 number
E4M3_CODES = _E2M1.to(torch.float8_e4m3fn).view(torch.uint8)
_BYTES = torch.arange(256)
# one packed byte -> its two values (low nibble first) / their E4M3 codes / the larger magnitude code (0..7)
_PAIR_VALUES = torch.stack([_E2M1[_BYTES & 0xF], _E2M1[_BYTES >> 4]], dim=-1)  # [256, 2] fp32
_PAIR_E4M3 = torch.stack([E4M3_CODES[_BYTES & 0xF], E4M3_CODES[_BYTES >> 4]], dim=-1)  # [256, 2] uint8
_PAIR_MAGNITUDE = torch.maximum(_BYTES & 0x7, (_BYTES >> 4) & 0x7).to(torch.uint8)  # [256]
# magnitude code 1..7 -> floor(log2 |value|): 0.5 -> -1, 1 and 1.5 -> 0, 2 and 3 -> 1, 4 and 6 -> 2
_EXPONENT = torch.tensor([0, -1, 0, 0, 1, 1, 2, 2], dtype=torch.int32)
_OVERFLOW = 128  # a value m * 2^e (1 <= m < 2) with e >= 128 is beyond bfloat16 / float32


def unpack(blocks: torch.Tensor) -> torch.Tensor:
    """[..., K/32, 16] uint8 -> E2M1 codes [..., K/32, 32] uint8, low nibble first."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1)  # [..., K/32, 16, 2]
    return codes.reshape(*blocks.shape[:-1], BLOCK)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [..., K/32, 32] (0..15) -> [..., K/32, 16] uint8, low nibble first (unpack's inverse)."""
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], BLOCK_BYTES, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def check_shapes(blocks_shape: tuple, scales_shape: tuple, where: str) -> None:
    """PrequantizedError unless blocks [..., N, K/32, 16] and scales [..., N, K/32] belong together."""
    if (
        len(blocks_shape) < 2
        or blocks_shape[-1] != BLOCK_BYTES
        or tuple(blocks_shape[:-1]) != tuple(scales_shape)
    ):
        raise PrequantizedError(
            f"{where}: MXFP4 blocks {list(blocks_shape)} and scales {list(scales_shape)} do not match "
            f"(expected blocks [..., N, K/32, {BLOCK_BYTES}] and scales [..., N, K/32])"
        )


def value_shape(blocks_shape: tuple) -> tuple:
    """The dequantized tensor's shape: [..., N, K/32, 16] -> [..., N, K]."""
    return (*blocks_shape[:-2], blocks_shape[-2] * BLOCK)


def _lookup(table: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """table [256, ...] indexed by every byte of blocks: [*blocks.shape, ...]."""
    idx = blocks.view(torch.uint8).reshape(-1).to(torch.int32)
    out = torch.index_select(table.to(blocks.device), 0, idx)
    return out.reshape(*blocks.shape, *table.shape[1:])


def problem(blocks: torch.Tensor, scales: torch.Tensor) -> Optional[str]:
    """What makes (blocks, scales) unconvertible (module docstring), with the first block where, or None."""
    s = scales.view(torch.uint8).to(torch.int32)  # [..., K/32]
    top = _lookup(_PAIR_MAGNITUDE, blocks).amax(-1).to(torch.int64)  # [..., K/32] largest magnitude code
    nonzero = top > 0
    checks = (
        (s == SCALE_NAN_BYTE, "scale byte 255 (E8M0 NaN)"),
        ((s == 0) & nonzero, "scale byte 0 (2^-127) on a block with non-zero values (a zeroed scale)"),
        (
            (s < SCALE_NAN_BYTE)
            & nonzero
            & (_EXPONENT.to(s.device)[top] + s - mxfp8.SCALE_BIAS >= _OVERFLOW),
            "a value of 2^128 or more (beyond bfloat16 and float32: scale byte 253 or 254)",
        ),
    )
    for bad, what in checks:
        where = bad.nonzero()
        if len(where):
            return f"{len(where)} block(s) with {what}, first at {_position(tuple(where[0].tolist()))}"
    return None


def check(blocks: torch.Tensor, scales: torch.Tensor, where: str) -> None:
    """PrequantizedError naming `where` unless every block converts exactly (module docstring)."""
    check_shapes(tuple(blocks.shape), tuple(scales.shape), where)
    why = problem(blocks, scales)
    if why:
        raise PrequantizedError(f"{where}: MXFP4 {why}; the checkpoint is damaged, re-download it")


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, where: str = "tensor"
) -> torch.Tensor:
    """(blocks [..., N, K/32, 16], scales [..., N, K/32]) -> values [..., N, K] in dtype; exact in bfloat16,
    float32 and float64 (what `check`, run first, guarantees)."""
    check(blocks, scales, where)
    vals = _lookup(_PAIR_VALUES, blocks).reshape(*scales.shape, BLOCK)  # [..., K/32, 32] fp32
    # times 2^(s - 127) in fp32: a power of two (pow2 is exact for every byte), the product a checked value
    # (at most 1.5 * 2^127, at least 0.5 * 2^-127, an fp32 subnormal), so exact
    vals.mul_(mxfp8.scale_multipliers(scales.view(torch.uint8)).unsqueeze(-1))
    return vals.reshape(value_shape(tuple(blocks.shape))).to(dtype)


def to_mxfp8(
    blocks: torch.Tensor, scales: torch.Tensor, where: str = "tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [..., N, K/32, 16], scales [..., N, K/32]) -> MXFP8 (q [..., N, K] float8_e4m3fn, scale
    [..., N, K/32] uint8): each code widened to the E4M3 code of the same value, each scale byte kept."""
    check(blocks, scales, where)
    q = _lookup(_PAIR_E4M3, blocks).reshape(value_shape(tuple(blocks.shape)))
    return q.view(torch.float8_e4m3fn), scales.view(torch.uint8).clone()


def encode_exact(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """dequantize's inverse for values that are MXFP4 under `scales` (uint8 [..., N, K/32]): w [..., N, K]
    -> blocks [..., N, K/32, 16]. Builds MXFP4 checkpoints (fixtures, benchmarks); ValueError when a value
    is not an E2M1 value times its block's scale."""
    inverse = mxfp8.pow2(mxfp8.SCALE_BIAS - scales.view(torch.uint8).to(torch.int32))  # exact, every byte
    x = w.float().reshape(*scales.shape, BLOCK) * inverse.unsqueeze(-1)
    hit = x.unsqueeze(-1) == _E2M1.to(x.device)  # [..., K/32, 32, 16]; 0.0 matches codes 0 and 8
    neg = torch.signbit(x)
    hit[..., 0] &= ~neg  # +0.0 -> code 0, -0.0 -> code 8
    hit[..., 8] &= neg
    if not bool(hit.any(-1).all()):
        raise ValueError("values are not E2M1 values times their block scales")
    return pack(hit.to(torch.uint8).argmax(-1))


def _position(idx: tuple) -> str:
    names = ("expert", "row", "block") if len(idx) == 3 else ("row", "block")
    return ", ".join(f"{k} {v}" for k, v in zip(names, idx[-len(names) :]))
