"""MXFP8 (OCP MX v1.0, E4M3 elements, UE8M0 scales, blocks of 32 along K): the one place for its math.

Used by the converter, the runtime backends and the tests alike. Rules (docs/mxfp8.md):

- block: 32 consecutive elements along the last dim (K); K % 32 == 0 is required.
- scale exponent e ("rceil"): the smallest integer with amax <= 448 * 2^e, derived exactly from
  frexp (no rounded log2). byte = e + 127 clamped to [0, 254]; an all-zero block gets byte 0.
  "floor" (OCP reference): e = floor(log2 amax) - 8; elements above 448 are clipped (lossier).
- elements: round-to-nearest-even cast of w / 2^(byte-127) to float8_e4m3fn, saturated to +-448.
- scales are stored as uint8 (safetensors U8), never float8_e8m0fnu.
- activations (quantize_activations, the serving kernels' rule, docs/moe-backends.md): the same rceil
  scale (one fp32 amax aside); a block whose scale byte is 0 gets zero elements; a block with NaN/Inf gets
  byte 255 (NaN).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from porter.errors import MXFP8Error
from porter.format import mxfp8_native

BLOCK = 32
E4M3_MAX = 448.0
SCALE_BIAS = 127
SCALE_MAX_BYTE = 254  # 255 is NaN in E8M0
ROUNDING_MODES = ("rceil", "floor")


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
    _check_rounding(rounding)


# ---- checks shared by the reference path and the CPU tile path ----


def _check_rounding(rounding: str) -> None:
    if rounding not in ROUNDING_MODES:
        raise MXFP8Error(f"unknown scale rounding {rounding!r}; use one of {ROUNDING_MODES}")


def _check_shape(w: torch.Tensor, name: str) -> None:
    if w.ndim < 1 or w.shape[-1] % BLOCK != 0:
        raise MXFP8Error(
            f"{name}: last dim (K) of shape {tuple(w.shape)} is not a multiple of {BLOCK}; "
            f"MXFP8 needs whole 32-element blocks — leave this tensor unquantized"
        )


def nonfinite_error(name: str) -> MXFP8Error:
    return MXFP8Error(f"{name}: contains NaN or Inf; fix the source checkpoint (refusing to quantize)")


def _check_finite(amax: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise nonfinite_error(name)


def _kept_bytes(keep_scale: torch.Tensor, amax: torch.Tensor, block_shape: tuple, name: str) -> torch.Tensor:
    """keep_scale as int32 bytes, checked: one per block (block_shape) and every block fits its byte
    (amax <= 448 * 2^(byte-127)); amax holds the same blocks, in any shape."""
    byte = keep_scale.to(device=amax.device, dtype=torch.int32)
    if byte.shape != block_shape or bool(
        (amax > E4M3_MAX * pow2(byte - SCALE_BIAS).reshape(amax.shape)).any()
    ):
        raise MXFP8Error(
            f"{name}: values do not fit the scale bytes they were read with "
            f"({tuple(byte.shape)} for blocks {tuple(block_shape)})"
        )
    return byte


def _quantize_blocks(
    w: torch.Tensor,
    rounding: str,
    name: str,
    ref: Optional[list] = None,
    keep_scale: Optional[torch.Tensor] = None,
    check_finite: bool = True,
):
    """-> (x: fp32 [..., K/32, 32] scaled, not clipped, q: e4m3 same shape (saturated), byte: int32 [..., K/32]).
    If `ref` is a list, the per-block sums of squares of w (fp32 [..., K/32]) are appended to it.
    keep_scale (uint8 [..., K/32]): use these scale bytes instead of the rounding rule — for values that
    came from MXFP8 with exactly these scales, re-quantizing is then the identity on bytes.
    check_finite=False: the caller has made every block finite (no device sync: CUDA-graph capturable)."""
    _check_shape(w, name)
    x = w.float()
    x = x.clone() if x is w else x  # private fp32 copy: scaled in place below
    x = x.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)  # [..., K/32, 32]
    amax = torch.maximum(x.amax(dim=-1), -x.amin(dim=-1))  # [..., K/32]; NaN propagates
    if ref is not None:
        ref.append(torch.linalg.vecdot(x, x))  # per-block sum of squares (square() is a slow pow on CPU)
    if check_finite:
        _check_finite(amax, name)
    if keep_scale is None:
        e = scale_exponents(amax, rounding)
        byte = (e + SCALE_BIAS).clamp(0, SCALE_MAX_BYTE)
        byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    else:
        byte = _kept_bytes(keep_scale, amax, amax.shape, name)
    # Multiply by 2^(127 - byte): an exact power-of-two scaling in fp32 (the factor is representable for
    # every byte, and products either stay exact or fall far below e4m3's smallest subnormal).
    x.mul_(pow2(SCALE_BIAS - byte).unsqueeze(-1))
    if rounding == "floor" and keep_scale is None:  # only floor's scales let |x| exceed 448: saturate the
        # cast (torch < 2.13 casts finite overflow to NaN) and keep x unclipped, so the error includes clipping
        return x, x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), byte
    return x, x.to(torch.float8_e4m3fn), byte  # the cast rounds to nearest even


def quantize(
    w: torch.Tensor, rounding: str = "rceil", name: str = "tensor", keep_scale: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] float -> (q [..., K] float8_e4m3fn, scale [..., K/32] uint8). keep_scale: see _quantize_blocks."""
    native = _quantize_native(w, rounding, keep_scale, with_error=False)
    if native is not None:
        return native[0], native[1]
    if _cpu_fast_path(w):
        q, byte, _ = _quantize_cpu_tiles(w, rounding, name, keep_scale, with_error=False)
        return q, byte
    _, q, byte = _quantize_blocks(w, rounding, name, keep_scale=keep_scale)
    return q.reshape(w.shape), byte.to(torch.uint8)


def quantize_with_error(
    w: torch.Tensor,
    rounding: str = "rceil",
    name: str = "tensor",
    host_stats: bool = True,
    keep_scale: Optional[torch.Tensor] = None,
    tile_blocks: Optional[int] = None,
):
    """quantize() plus the pieces of the error statistics, computed on the same fp32 blocks, on w's device
    (CPU or CUDA: the same bytes):
    -> (q, scale, {"err_sq", "ref_sq", "max_abs_error"}) with err_sq = ||W - deq(Q)||^2, ref_sq = ||W||^2.
    Per-block sums are fp32 (32 terms, torch's mul + sum over the block, which is what linalg.vecdot runs),
    block totals are summed in float64. host_stats=False leaves the three numbers as float64 0-dim tensors on
    w's device (no device sync here). keep_scale: see _quantize_blocks (an MXFP8 source keeps its own scale
    bytes). On the CPU the compiled C loop does the work where it takes w (_quantize_native; `tile_blocks` does
    not apply to it), else the torch ops tile by tile (_quantize_cpu_tiles) of `tile_blocks` blocks (default
    CPU_TILE_BLOCKS); the bytes and numbers do not depend on the tile size."""
    native = _quantize_native(w, rounding, keep_scale, with_error=True)
    if native is not None:
        q, byte, parts = native
    elif _cpu_fast_path(w):
        q, byte, parts = _quantize_cpu_tiles(
            w, rounding, name, keep_scale, with_error=True, tile_blocks=tile_blocks
        )
    else:
        q, byte, parts = _quantize_general(w, rounding, name, keep_scale, with_error=True)
    stats = _error_totals(*(p.reshape(byte.shape) for p in parts), byte, w.device)
    if host_stats:
        stats = {k: float(v) for k, v in stats.items()}
    return q, byte, stats


def _error_totals(
    ref_sq: torch.Tensor, err_sq: torch.Tensor, d_max: Optional[torch.Tensor], byte: torch.Tensor, device
) -> dict:
    """Per-block fp32 sums ([..., K/32]: ||w||^2, ||scaled error||^2, max |scaled error|) -> float64 totals
    in the original domain. step = 2^(byte-127) and step^2 are built as float64 bit patterns (exponent field
    byte + 896, resp. 2 byte + 769: normal for every byte 0..254, so exactly pow2(byte - 127).double() and its
    square); the float64 products are exact, only the sums round."""
    e = byte.to(torch.int64)
    step = ((e + 896) << 52).view(torch.float64)  # [..., K/32]
    step_sq = ((2 * e + 769) << 52).view(torch.float64)
    err = (err_sq.double() * step_sq).sum()
    max_abs = (
        (d_max.double() * step).max()
        if d_max is not None and d_max.numel()
        else torch.zeros((), dtype=torch.float64, device=device)
    )
    return {"err_sq": err, "ref_sq": ref_sq.double().sum(), "max_abs_error": max_abs}


# ---- CPU fast path --------------------------------------------------------------------------------------
# The rule above, computed on tiles of CPU_TILE_BLOCKS blocks with buffers reused across tiles and calls:
# each tile's fp32 copy, its squares and its decoded values stay in the core's L2 cache, and every step is
# one fused torch op writing into a buffer (no temporaries). Same bytes and same statistics as
# _quantize_blocks + the general error path, for the reasons given at each step (tests/test_mxfp8.py checks
# them against a direct implementation of the rule and exhaustively where a shortcut needs it).

CPU_TILE_BLOCKS = 3072  # 98,304 elements: fp32 copy + squares + int16 decode ~1.1 MB, fits one core's L2;
# many threads at once want larger tiles (every torch op re-takes the GIL): porter.engine.units.quant_sizes
_SQUARE_EXACT = (torch.bfloat16, torch.float16)  # <= 11 significant bits: x*x is exact in fp32
_FLOAT32_MAX = torch.finfo(torch.float32).max
_tile_buffers = threading.local()  # one set per thread: conversion workers run quantization concurrently


def _quantize_native(w: torch.Tensor, rounding: str, keep_scale, with_error: bool):
    """The rule as compiled C (porter.format.mxfp8_native) where it takes w: same bytes, a few times the torch
    tiles' rate per core; None otherwise, and for a w with NaN or Inf (the torch path then names it)."""
    _check_rounding(rounding)
    if not mxfp8_native.supports(w, keep_scale):
        return None
    return mxfp8_native.quantize_blocks(w, rounding, with_error)


def _cpu_fast_path(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float16, torch.float32) and w.numel() > 0
    )


def _buffers(blocks: int):
    bufs = getattr(_tile_buffers, "bufs", None)
    if bufs is None or bufs[0].shape[0] < blocks:
        bufs = _tile_buffers.bufs = (
            torch.empty(blocks, BLOCK),
            torch.empty(blocks, BLOCK),
            torch.empty(blocks, BLOCK, dtype=torch.int16),
        )
    return [b[:blocks] for b in bufs]


def _scale_field(amax: torch.Tensor, rounding: str) -> torch.Tensor:
    """fp32 block amax (finite, >= 0) -> int32 k with byte = max(k - 8, 0): the rule of scale_exponents on the
    bits. Normal amax = (1 + M/2^23) * 2^(E-127), so frexp's exponent is E - 126 and its mantissa <= 0.875
    iff M <= 0x600000: rceil byte = E - 8 (M <= 0x600000) or E - 7, i.e. ((bits + 0x1FFFFF) >> 23) - 8 (the
    add carries into E exactly when M > 0x600000); floor byte = E - 8. Subnormal and zero amax give k <= 1,
    byte 0, as the clamp does. k <= 255, so byte <= 247 never reaches the clamp's top."""
    bits = amax.view(torch.int32)
    return (bits + 0x1FFFFF if rounding == "rceil" else bits) >> 23


def _e4m3_as_fp16_div256(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """e4m3 codes -> their values / 2^8 as float16, exactly, in a few int16 ops (q.float() is a slow scalar
    loop on the CPU): code s.eeee.mmm placed as fp16 bits s.0eeee.mmm0000000 has exponent field E (bias 15
    instead of 7) and the same mantissa, i.e. the value times 2^-8, normal and subnormal codes alike.
    out: int16 buffer of q's shape."""
    out.copy_(q.view(torch.int8))  # sign-extends: a negative code sets bits 8..15
    out.bitwise_left_shift_(7).bitwise_and_(-0x4080)  # 0xBF80: sign bit, 4 exponent bits, 3 mantissa bits
    return out.view(torch.float16)


def _quantize_cpu_tiles(
    w: torch.Tensor,
    rounding: str,
    name: str,
    keep_scale: Optional[torch.Tensor],
    with_error: bool,
    tile_blocks: Optional[int] = None,
):
    """-> (q [..., K] e4m3, byte [..., K/32] uint8, (ref_sq, err_sq, max |err|) fp32 [NB] or None); err is
    the scaled-domain error x - float(q).
    Two passes over the tiles: block amax (and ||w||^2) first, the scales for the whole call from those in a
    few ops, then scaling, the cast and the error; re-widening a tile costs less than per-tile scale ops."""
    _check_shape(w, name)
    _check_rounding(rounding)
    src = w.reshape(-1, BLOCK)  # [NB, 32]
    nb = src.shape[0]
    by_squares = w.dtype in _SQUARE_EXACT

    tile = tile_blocks or CPU_TILE_BLOCKS

    def tiles(t: torch.Tensor):  # views of `tile` blocks
        return t.split(tile)

    parts = tuple(torch.empty(nb) for _ in range(3)) if with_error else None  # ref_sq, err_sq, max|err|
    amax = torch.empty(nb)  # [NB] fp32
    refs = tiles(parts[0]) if with_error else iter(lambda: None, 0)
    for w_t, amax_t, ref_t in zip(tiles(src), tiles(amax), refs):
        x, sq, _ = _buffers(w_t.shape[0])  # [n, 32] fp32, fp32
        if by_squares or with_error:
            x.copy_(w_t)  # exact widening to fp32
            torch.mul(x, x, out=sq)
        if with_error:
            torch.sum(sq, -1, out=ref_t)  # = linalg.vecdot(x, x): ||w||^2 per block
        if by_squares:  # amax^2 = max of the squares: x*x is exact here and monotone in |x|
            torch.amax(sq, -1, out=amax_t)
        else:
            torch.maximum(w_t.amax(-1), w_t.amin(-1).neg_(), out=amax_t)
    if by_squares:
        # amax = sqrt(amax^2) exactly (sqrt is correctly rounded) while amax^2 is 0 or a normal float;
        # otherwise (|w| >= 2^64 or < 2^-63 somewhere, NaN or Inf) the general path decides.
        lo, hi = torch.aminmax(amax)
        if not (float(hi) <= _FLOAT32_MAX and float(lo) >= 2.0**-126) and not bool(
            ((amax == 0) | ((amax >= 2.0**-126) & (amax <= _FLOAT32_MAX))).all()
        ):
            return _quantize_general(w, rounding, name, keep_scale, with_error)
        amax.sqrt_()
    else:
        _check_finite(amax, name)
    block_shape = (*w.shape[:-1], w.shape[-1] // BLOCK)
    if keep_scale is None:
        k = _scale_field(amax, rounding)  # [NB] int32
        byte = (k - 8).clamp_min_(0)
        # 2^(127 - byte): the float with exponent field 254 - byte = min(262 - k, 254), in [7, 254]
        mult = (262 - k).clamp_max_(254).bitwise_left_shift_(23).view(torch.float32)
    else:
        byte = _kept_bytes(keep_scale, amax, block_shape, name)
        mult = pow2(SCALE_BIAS - byte).reshape(-1)
    clamp = rounding == "floor" and keep_scale is None  # rceil, and kept scales that fit, never exceed 448
    q = torch.empty(nb, BLOCK, dtype=torch.float8_e4m3fn)
    stats = zip(tiles(parts[1]), tiles(parts[2].view(torch.int32))) if with_error else iter(lambda: None, 0)
    for w_t, mult_t, q_t, stat_t in zip(tiles(src), tiles(mult.unsqueeze(-1)), tiles(q), stats):
        x, d, h = _buffers(w_t.shape[0])  # [n, 32] fp32, fp32, int16
        x.copy_(w_t)
        x.mul_(mult_t)  # exact power-of-two scaling (see _quantize_blocks)
        if clamp:  # saturate the cast; x stays unclipped so the error includes floor's clipping
            q_t.copy_(torch.clamp(x, -E4M3_MAX, E4M3_MAX, out=d))
        else:
            q_t.copy_(x)  # round to nearest even: the same cast as .to(float8_e4m3fn)
        if with_error:
            err_t, dmax_t = stat_t
            d.copy_(_e4m3_as_fp16_div256(q_t, h))  # exact
            torch.sub(x, d, alpha=256, out=d)  # [n, 32] x - float(q): the scaled-domain error, exact in fp32
            torch.mul(d, d, out=x)
            torch.sum(x, -1, out=err_t)  # = linalg.vecdot(err, err)
            # max |err| on the bits: clearing the sign leaves ints ordered as the magnitudes (all finite)
            torch.amax(d.view(torch.int32).bitwise_and_(0x7FFFFFFF), -1, out=dmax_t)
    return q.reshape(w.shape), byte.to(torch.uint8).reshape(block_shape), parts


def _quantize_general(w, rounding, name, keep_scale, with_error):
    """The reference path in the tiled path's return format: CUDA, other dtypes, and the rare CPU inputs the
    tiled path's shortcuts do not cover."""
    ref = []
    x, q, byte = _quantize_blocks(w, rounding, name, ref if with_error else None, keep_scale)
    parts = None
    if with_error:
        x.sub_(
            e4m3_to_float(q)
        )  # scaled-domain error, exact in fp32 (x unclipped: floor's clipping is in it)
        parts = (ref[0], torch.linalg.vecdot(x, x), x.abs().amax(-1))  # [..., K/32] each
    return q.reshape(w.shape), byte.to(torch.uint8), parts


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
        raise MXFP8Error(
            f"scale shape {tuple(scale.shape)} does not match values {tuple(q.shape)} "
            f"(expected [..., {k // BLOCK}])"
        )
    vals = e4m3_to_float(q.view(torch.float8_e4m3fn)).reshape(*scale.shape, BLOCK)  # [..., K/32, 32]
    return (vals * scale_multipliers(scale).unsqueeze(-1)).reshape(q.shape).to(dtype)


def fake_quantize(w: torch.Tensor, rounding: str = "rceil", name: str = "tensor") -> torch.Tensor:
    """quantize then dequantize, in w's dtype (what a backend computes with)."""
    q, s = quantize(w, rounding, name)
    return dequantize(q, s, w.dtype)


# ---- activations: what the serving kernels compute (docs/moe-backends.md, "Serving numerics") ----

SCALE_NAN_BYTE = 255  # E8M0 NaN: marks a block of activations that held NaN or Inf
_E4M3_NAN_CODE = 0x7F


def quantize_activations(x: torch.Tensor, name: str = "activations") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] float8_e4m3fn, scale [..., K/32] uint8, token-major and linear), as
    FlashInfer's mxfp8_quantize quantizes a MoE input (and the TRT-LLM FC1 epilogue its SwiGLU output).

    The scale byte is FlashInfer's round-up of fl(amax / 448): quantize()'s rceil byte, except for the one
    fp32 amax just above 448 * 2^-127, whose quotient rounds down to 2^-127 (byte 0, not 1; bf16 and fp16
    never land there). Two more differences from quantize(), both FlashInfer's:
    a block with byte 0 (amax <= 448 * 2^-127, all-zero blocks included) gets zero elements (its inverse
    scale is 0, where quantize() scales by 2^127), and a block holding NaN/Inf is not refused but gets byte
    255 and NaN elements, so a NaN propagates through the layer as in the w8a16 path."""
    _check_shape(x, name)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)  # [..., K/32, 32]
    bad = ~torch.isfinite(blocks).all(-1)  # [..., K/32]
    blocks = blocks.masked_fill(bad.unsqueeze(-1), 0)
    # No host sync on a GPU (the serving MoE runs inside captured decode steps): every mask is applied
    # unconditionally, and the blocks are finite here.
    if x.is_cuda:
        _, q, scale = _quantize_blocks(blocks.reshape(x.shape), "rceil", name, check_finite=False)
        q, scale = q.reshape(x.shape), scale.to(torch.uint8)
    else:
        q, scale = quantize(blocks.reshape(x.shape), "rceil", name)
    # amax / 448 <= 2^-126 is an fp32 subnormal: FlashInfer rounds it to fp32 first, and one that rounds to
    # 2^-127 keeps byte 0
    amax = blocks.abs().amax(-1).float()
    scale = scale.masked_fill((scale == 1) & (amax / E4M3_MAX <= 2.0**-127), 0)
    codes = q.view(torch.uint8).reshape(blocks.shape)  # [..., K/32, 32]
    codes = codes.masked_fill((scale == 0).unsqueeze(-1), 0)
    codes = codes.masked_fill(bad.unsqueeze(-1), _E4M3_NAN_CODE)
    scale = scale.masked_fill(bad, SCALE_NAN_BYTE)
    return codes.reshape(x.shape).view(torch.float8_e4m3fn), scale


def fake_quantize_activations(
    x: torch.Tensor, dtype: Optional[torch.dtype] = None, name: str = "activations"
) -> torch.Tensor:
    """quantize_activations then dequantize (computed in fp32), in dtype (default x.dtype): the values the
    serving kernel's GEMM reads."""
    q, scale = quantize_activations(x, name)
    return dequantize(q, scale, x.dtype if dtype is None else dtype)


def error_stats(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> dict:
    """||W - deq(Q)|| / ||W|| and max |W - deq(Q)|, in float64."""
    w64 = w.double()
    diff = w64 - dequantize(q, scale).double()
    norm = float(w64.norm())
    return {
        "rel_fro_error": float(diff.norm()) / norm if norm > 0 else 0.0,
        "max_abs_error": float(diff.abs().max()) if diff.numel() else 0.0,
    }


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Block-scaled FP8 source checkpoints (DeepSeek-V3 style, `weight_block_size [bn, bk]`, usually
    [128, 128]): (q [..., N, K] e4m3, scale_inv float [..., ceil(N/bn), ceil(K/bk)]) -> q * scale_inv
    per [bn, bk] tile (edge tiles are partial), computed in fp32."""
    bn, bk = block
    n, k = q.shape[-2], q.shape[-1]
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise MXFP8Error(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match values {tuple(q.shape)} "
            f"with block [{bn}, {bk}] (expected {list(want)})"
        )
    if dtype == torch.bfloat16:  # the C loop: the same bytes in one pass (porter/format/mxfp8_native.py)
        out = mxfp8_native.dequantize_fp8_block(q.view(torch.uint8), scale_inv, (bn, bk))
        if out is not None:
            return out
    values = e4m3_to_float(q.view(torch.float8_e4m3fn))  # [..., N, K] fp32, a fresh tensor
    if (
        n % bn == 0 and k % bk == 0
    ):  # whole tiles: scale each in place through a [.., N/bn, bn, K/bk, bk] view
        tiles = values.view(*q.shape[:-2], n // bn, bn, k // bk, bk)
        tiles.mul_(scale_inv.float()[..., :, None, :, None])  # the same fp32 products, no expanded scale
        return values.to(dtype)
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (values * s).to(dtype)
