"""MXFP4 (porter.format.mxfp4): the release's packing read as transformers reads it, and MXFP4 -> MXFP8 exact
for every E2M1 code under every scale byte, by both routes porter has (the direct widening, and the
conversion's: dequantize to bfloat16, re-quantize with the kept scale bytes)."""

from __future__ import annotations

import math

import pytest
import torch

from porter.errors import PrequantizedError
from porter.format import mxfp4, mxfp8

ALL_CODES = torch.arange(32) % 16  # one block holding every E2M1 code twice


def _blocks_of(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K/32, 32] -> packed blocks [..., K/32, 16]."""
    return mxfp4.pack(codes)


def _exact(code: int, byte: int) -> float:
    """The MXFP4 value by the spec, in float64 (exact: Python floats hold every one of them)."""
    return math.ldexp(mxfp4.E2M1_VALUES[code], byte - 127)


def _f64_bits(t: torch.Tensor) -> torch.Tensor:
    return t.double().view(torch.int64)


def test_e2m1_table_is_the_spec_and_e4m3_holds_each_value():
    # sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal (0, 0.5)
    for code in range(16):
        sign = -1.0 if code & 8 else 1.0
        e, m = (code >> 1) & 3, code & 1
        want = sign * (m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1))
        assert mxfp4.E2M1_VALUES[code] == want and math.copysign(1, mxfp4.E2M1_VALUES[code]) == sign
    e4m3 = mxfp4.E4M3_CODES.view(torch.float8_e4m3fn).float()
    assert torch.equal(_f64_bits(e4m3), _f64_bits(torch.tensor(mxfp4.E2M1_VALUES)))  # -0.0 kept too
    # every non-zero value is a normal e4m3 number (exponent field 1..15), not a subnormal
    mags = mxfp4.E4M3_CODES[[c for c in range(16) if c & 7]]
    assert bool(((mags >> 3) & 0xF).ge(1).all())


def test_low_nibble_first_and_pack_inverse():
    b = torch.tensor([[0x21, 0xF8] + [0] * 14], dtype=torch.uint8)  # [1 block, 16 bytes]
    codes = mxfp4.unpack(b)
    assert codes[0, :4].tolist() == [1, 2, 8, 15]  # byte 0x21: low nibble 1 first, then 2
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    assert torch.equal(mxfp4.pack(mxfp4.unpack(blocks)), blocks)


def test_dequantize_matches_transformers_reader():
    """transformers 5.23 integrations/mxfp4.py (the oracle) dequantizes [E, N, K/32, 16] -> [E, K, N]."""
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 6, 4, 16), dtype=torch.uint8, generator=g)  # [E, N, K/32, 16]
    scales = torch.randint(110, 140, (3, 6, 4), dtype=torch.uint8, generator=g)
    want = mx.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, K, N]
    got = mxfp4.dequantize(blocks, scales, torch.bfloat16)  # [E, N, K]
    assert got.shape == (3, 6, 128)
    assert torch.equal(got.transpose(1, 2).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("byte", range(1, 253))
def test_every_code_every_scale_is_exact_both_routes(byte):
    """Bytes 1..252 hold every code: MXFP8 dequantizes to the MXFP4 values bit for bit (float64), whether
    widened directly or re-quantized from bfloat16 with the kept byte (what the conversion does)."""
    codes = ALL_CODES.reshape(1, 1, 32)
    blocks, scales = _blocks_of(codes), torch.full((1, 1), byte, dtype=torch.uint8)
    want = torch.tensor([_exact(int(c), byte) for c in ALL_CODES], dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        got = mxfp4.dequantize(blocks, scales, dtype).reshape(-1)
        assert torch.equal(_f64_bits(got), _f64_bits(want)), dtype
    q, s = mxfp4.to_mxfp8(blocks, scales)
    assert torch.equal(s, scales)
    assert torch.equal(_f64_bits(mxfp8.dequantize(q, s).reshape(-1)), _f64_bits(want))
    via_bf16 = mxfp4.dequantize(blocks, scales, torch.bfloat16).reshape(1, 32)
    q2, s2 = mxfp8.quantize(via_bf16, "rceil", "t", keep_scale=scales)
    assert torch.equal(q2.view(torch.uint8), q.reshape(1, 32).view(torch.uint8)) and torch.equal(s2, s)


def test_all_bytes_at_once_through_every_quantizer_path():
    """Bytes 1..252 in one tensor, through mxfp8's CPU tile path and its general (CUDA) path."""
    bytes_ = torch.arange(1, 253, dtype=torch.uint8)[:, None]  # [252, 1]
    blocks = _blocks_of(ALL_CODES.expand(252, 1, 32))
    values = mxfp4.dequantize(blocks, bytes_, torch.bfloat16)  # [252, 32]
    q, s = mxfp4.to_mxfp8(blocks, bytes_)
    tiles = mxfp8._quantize_cpu_tiles(values, "rceil", "t", bytes_, with_error=False)
    general = mxfp8._quantize_general(values, "rceil", "t", bytes_, with_error=False)
    for qq, ss, _ in (tiles, general):
        assert torch.equal(qq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ss, s)


@pytest.mark.parametrize(
    "byte, top_ok, first_bad", [(253, 3.0, 4.0), (254, 1.5, 2.0)]
)  # largest magnitude that fits, smallest that does not
def test_top_scale_bytes_fit_below_2_pow_128_and_refuse_above(byte, top_ok, first_bad):
    fits = [c for c in range(16) if abs(mxfp4.E2M1_VALUES[c]) <= top_ok]
    codes = torch.tensor(fits * (32 // len(fits)) + fits[: 32 % len(fits)]).reshape(1, 1, 32)
    scales = torch.full((1, 1), byte, dtype=torch.uint8)
    got = mxfp4.dequantize(_blocks_of(codes), scales, torch.bfloat16)
    want = torch.tensor([_exact(int(c), byte) for c in codes.reshape(-1)], dtype=torch.float64)
    assert torch.equal(_f64_bits(got.reshape(-1)), _f64_bits(want))
    assert bool(torch.isfinite(got).all())
    q, s = mxfp4.to_mxfp8(_blocks_of(codes), scales)
    assert torch.equal(_f64_bits(mxfp8.dequantize(q, s, torch.float64).reshape(-1)), _f64_bits(want))
    bad = codes.clone()
    bad[0, 0, 5] = mxfp4.E2M1_VALUES.index(first_bad)
    with pytest.raises(
        PrequantizedError, match=r"experts\.gate_up_proj_blocks: MXFP4 1 block\(s\) with a value of 2\^128"
    ):
        mxfp4.dequantize(_blocks_of(bad), scales, where="model.layers.0.mlp.experts.gate_up_proj_blocks")
    with pytest.raises(PrequantizedError, match="2\\^128"):
        mxfp4.to_mxfp8(_blocks_of(bad), scales)


def test_byte_zero_only_for_zero_blocks_and_byte_255_refused():
    zero = torch.zeros(2, 3, 32, dtype=torch.int64)
    zero[1, 2] = 8  # -0.0 everywhere: still a zero block
    scales = torch.zeros(2, 3, dtype=torch.uint8)
    q, s = mxfp4.to_mxfp8(_blocks_of(zero), scales)
    assert torch.equal(s, scales) and not bool((q.view(torch.uint8) & 0x7F).any())
    smallest = zero.clone()
    smallest[1, 2, 7] = 1  # 0.5 * 2^-127 under byte 0: a zeroed scale, refused
    with pytest.raises(
        PrequantizedError,
        match=r"T: MXFP4 1 block\(s\) with scale byte 0 .* first at expert 1, row 2, block 0",
    ):
        mxfp4.dequantize(_blocks_of(smallest.reshape(2, 3, 1, 32)), scales.reshape(2, 3, 1), where="T")
    # the smallest value a real block can hold: 0.5 * 2^-126 (byte 1), exact in bfloat16 as a subnormal
    v = mxfp4.dequantize(_blocks_of(smallest), torch.ones(2, 3, dtype=torch.uint8), torch.bfloat16)
    assert float(v.reshape(2, 3, 32)[1, 2, 7]) == 2.0**-127
    nan = torch.full((1, 1), 255, dtype=torch.uint8)
    with pytest.raises(PrequantizedError, match="scale byte 255"):
        mxfp4.to_mxfp8(_blocks_of(zero[:1, :1]), nan)


def test_shapes_checked():
    with pytest.raises(PrequantizedError, match=r"W: MXFP4 blocks \[2, 3, 16\] and scales \[2, 4\]"):
        mxfp4.dequantize(
            torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), where="W"
        )


def test_encode_exact_inverts_dequantize_and_refuses_non_mxfp4():
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (4, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(1, 253, (4, 3), dtype=torch.uint8, generator=g)
    zeros = (mxfp4.unpack(blocks) & 7) == 0  # +-0.0 stay apart
    assert torch.equal(mxfp4.encode_exact(mxfp4.dequantize(blocks, scales, torch.float32), scales), blocks)
    assert zeros.any()
    w = mxfp4.dequantize(blocks, scales, torch.float32)
    w[0, 0] = w[0, 0] * 1.25 + 1.0  # no longer on the grid
    with pytest.raises(ValueError):
        mxfp4.encode_exact(w, scales)
