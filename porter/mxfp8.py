"""MXFP8 (OCP MX v1.0, E4M3 elements, UE8M0 scales, blocks of 32 along K): the one place for its math.

Used by the converter, the runtime backends and the tests alike. Rules (docs/mxfp8.md):

- block: 32 consecutive elements along the last dim (K); K % 32 == 0 is required.
- scale exponent e ("rceil"): the smallest integer with amax <= 448 * 2^e, derived exactly from
  frexp (no rounded log2). byte = e + 127 clamped to [0, 254]; an all-zero block gets byte 0.
  "floor" (OCP reference): e = floor(log2 amax) - 8; elements above 448 are clipped (lossier).
- elements: round-to-nearest-even cast of w / 2^(byte-127) to float8_e4m3fn, saturated to +-448.
- scales are stored as uint8 (safetensors U8), never float8_e8m0fnu.
"""
from __future__ import annotations

from typing import Optional

import torch
from porter.errors import PorterError

BLOCK = 32
E4M3_MAX = 448.0
SCALE_BIAS = 127
SCALE_MAX_BYTE = 254  # 255 is NaN in E8M0
ROUNDING_MODES = ("rceil", "floor")


class MXFP8Error(PorterError, ValueError):
    """Bad input for MXFP8 quantization (names the tensor)."""


def scale_exponents(amax: torch.Tensor, rounding: str = "rceil") -> torch.Tensor:
    """Unclamped int32 exponents e per block from fp32 block amax (amax > 0 assumed where used).

    frexp gives amax = m * 2^x with m in [0.5, 1); 448 = 0.875 * 2^9, so
    rceil: amax <= 448 * 2^e  <=>  e >= x - 9 when m <= 0.875, else e >= x - 8 (exact comparisons).
    floor: floor(log2 amax) - 8 = (x - 1) - 8.
    """
    mant, expo = torch.frexp(amax.float())
    expo = expo.to(torch.int32)
    if rounding == "rceil":
        return torch.where(mant <= 0.875, expo - 9, expo - 8)
    if rounding == "floor":
        return expo - 9
    raise MXFP8Error(f"unknown scale rounding {rounding!r}; use one of {ROUNDING_MODES}")


def _check_shape(w: torch.Tensor, name: str) -> None:
    if w.ndim < 1 or w.shape[-1] % BLOCK != 0:
        raise MXFP8Error(
            f"{name}: last dim (K) of shape {tuple(w.shape)} is not a multiple of {BLOCK}; "
            f"MXFP8 needs whole 32-element blocks — leave this tensor unquantized")


def _quantize_blocks(w: torch.Tensor, rounding: str, name: str, ref: Optional[list] = None,
                     keep_scale: Optional[torch.Tensor] = None):
    """-> (x: fp32 [..., K/32, 32] scaled and clamped, q: e4m3 same shape, byte: int32 [..., K/32]).
    If `ref` is a list, the per-block sums of squares of w (fp32 [..., K/32]) are appended to it.
    keep_scale (uint8 [..., K/32]): use these scale bytes instead of the rounding rule — for values that
    came from MXFP8 with exactly these scales, re-quantizing is then the identity on bytes."""
    _check_shape(w, name)
    x = w.float()
    x = x.clone() if x is w else x  # private fp32 copy: scaled in place below
    x = x.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)  # [..., K/32, 32]
    amax = torch.maximum(x.amax(dim=-1), -x.amin(dim=-1))  # [..., K/32]; NaN propagates
    if ref is not None:
        ref.append(torch.linalg.vecdot(x, x))  # per-block sum of squares (square() is a slow pow on CPU)
    if not bool(torch.isfinite(amax).all()):
        raise MXFP8Error(f"{name}: contains NaN or Inf; fix the source checkpoint (refusing to quantize)")
    if keep_scale is None:
        e = scale_exponents(amax, rounding)
        byte = (e + SCALE_BIAS).clamp(0, SCALE_MAX_BYTE)
        byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    else:
        byte = keep_scale.to(device=amax.device, dtype=torch.int32)
        if byte.shape != amax.shape or bool((amax > E4M3_MAX * pow2(byte - SCALE_BIAS)).any()):
            raise MXFP8Error(f"{name}: values do not fit the scale bytes they were read with "
                             f"({tuple(byte.shape)} for blocks {tuple(amax.shape)})")
    # Multiply by 2^(127 - byte): an exact power-of-two scaling in fp32 (the factor is representable for
    # every byte, and products either stay exact or fall far below e4m3's smallest subnormal).
    x.mul_(pow2(SCALE_BIAS - byte).unsqueeze(-1))
    x.clamp_(-E4M3_MAX, E4M3_MAX)  # saturate (torch < 2.13 casts finite overflow to NaN)
    return x, x.to(torch.float8_e4m3fn), byte  # the cast rounds to nearest even


def quantize(w: torch.Tensor, rounding: str = "rceil", name: str = "tensor",
             keep_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] float -> (q [..., K] float8_e4m3fn, scale [..., K/32] uint8). keep_scale: see _quantize_blocks."""
    _, q, byte = _quantize_blocks(w, rounding, name, keep_scale=keep_scale)
    return q.reshape(w.shape), byte.to(torch.uint8)


def quantize_with_error(w: torch.Tensor, rounding: str = "rceil", name: str = "tensor", host_stats: bool = True,
                        keep_scale: Optional[torch.Tensor] = None):
    """quantize() plus the pieces of the error statistics, computed on the same fp32 blocks, on w's device
    (CPU or CUDA: the same ops, so the same bytes):
    -> (q, scale, {"err_sq", "ref_sq", "max_abs_error"}) with err_sq = ||W - deq(Q)||^2, ref_sq = ||W||^2.
    Per-block sums are fp32 (32 terms), block totals are summed in float64. host_stats=False leaves the
    three numbers as float64 0-dim tensors on w's device (no device sync here). keep_scale: see
    _quantize_blocks (an MXFP8 source keeps its own scale bytes)."""
    ref = []
    x, q, byte = _quantize_blocks(w, rounding, name, ref, keep_scale)
    x.sub_(e4m3_to_float(q))  # scaled-domain rounding (and clipping) error, exact in fp32
    step = pow2(byte - SCALE_BIAS).double()  # [..., K/32]
    err_sq = (torch.linalg.vecdot(x, x).double() * step.square()).sum()
    max_abs = (x.abs().amax(dim=-1).double() * step).max() if x.numel() else torch.zeros((), dtype=torch.float64,
                                                                                           device=w.device)
    ref_sq = ref[0].double().sum()
    stats = {"err_sq": err_sq, "ref_sq": ref_sq, "max_abs_error": max_abs}
    if host_stats:
        stats = {k: float(v) for k, v in stats.items()}
    return q.reshape(w.shape), byte.to(torch.uint8), stats


_E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # code -> value


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32 by table lookup (same values as q.float(), several times faster on CPU)."""
    if q.device.type != "cpu":
        return q.float()
    codes = q.reshape(-1).view(torch.uint8).int()
    return torch.index_select(_E4M3_TABLE, 0, codes).reshape(q.shape)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-149, 127], built from exponent bits (exact; no pow)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp_min(0) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def scale_multipliers(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 UE8M0 bytes -> 2^(byte-127) (exact for every byte 0..254)."""
    return pow2(scale.to(torch.int32) - SCALE_BIAS).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [..., K] e4m3, scale [..., K/32] uint8) -> w [..., K] in dtype (computed in fp32)."""
    k = q.shape[-1]
    if scale.shape[-1] * BLOCK != k or scale.shape[:-1] != q.shape[:-1]:
        raise MXFP8Error(f"scale shape {tuple(scale.shape)} does not match values {tuple(q.shape)} "
                         f"(expected [..., {k // BLOCK}])")
    vals = q.view(torch.float8_e4m3fn).float().reshape(*scale.shape, BLOCK)  # [..., K/32, 32]
    return (vals * scale_multipliers(scale).unsqueeze(-1)).reshape(q.shape).to(dtype)


def fake_quantize(w: torch.Tensor, rounding: str = "rceil", name: str = "tensor") -> torch.Tensor:
    """quantize then dequantize, in w's dtype (what a backend computes with)."""
    q, s = quantize(w, rounding, name)
    return dequantize(q, s, w.dtype)


def error_stats(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> dict:
    """||W - deq(Q)|| / ||W|| and max |W - deq(Q)|, in float64."""
    w64 = w.double()
    diff = w64 - dequantize(q, scale).double()
    norm = float(w64.norm())
    return {"rel_fro_error": float(diff.norm()) / norm if norm > 0 else 0.0,
            "max_abs_error": float(diff.abs().max()) if diff.numel() else 0.0}


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-scaled FP8 source checkpoints (DeepSeek-V3 style, `weight_block_size [bn, bk]`, usually
    [128, 128]): (q [..., N, K] e4m3, scale_inv float [..., ceil(N/bn), ceil(K/bk)]) -> q * scale_inv
    per [bn, bk] tile (edge tiles are partial), computed in fp32."""
    bn, bk = block
    n, k = q.shape[-2], q.shape[-1]
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise MXFP8Error(f"scale_inv shape {tuple(scale_inv.shape)} does not match values {tuple(q.shape)} "
                         f"with block [{bn}, {bk}] (expected {list(want)})")
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (e4m3_to_float(q.view(torch.float8_e4m3fn)) * s).to(dtype)
