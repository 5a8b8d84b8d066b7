"""porter.format.mxfp8.quantize_activations: the serving kernels' MXFP8 rule for activations, against closed
forms written here (hand-computed blocks) and against FlashInfer's reference bit rule transcribed here
(flashinfer-ai/flashinfer tests/utils_fp8.py `mxfp8_quantize_reference`: byte = exponent field of
fl(amax / 448), +1 when a mantissa bit is set, fp32-subnormal case, <= 254, 0 for zero; inverse scale 0
for byte 0). docs/moe-backends.md, "Serving numerics". The engines' own torch quantizers are compared in
tests/engines/test_activation_quant.py."""

from __future__ import annotations

import pytest
import torch

from porter.format import mxfp8

E4M3_CODE = {448.0: 0x7E, -448.0: 0xFE, 256.0: 0x78, 320.0: 0x7A, 224.0: 0x76, 0.25: 0x28, -0.75: 0xB4}


def block(*head, fill=0.0):
    """One 32-block: the given leading values, then `fill`."""
    return list(head) + [fill] * (32 - len(head))


def codes(q):
    return q.view(torch.uint8)


def test_hand_computed_blocks():
    rows = torch.tensor(
        [
            block(1.0, -3.0, 0.1, 1344.0),  # amax 1344 = 3 * 448 -> scale 4 = 2^2: byte 129; 336 ties to 320
            block(fill=0.5),  # 0.5 / 448 -> 2^-9 (2^-9.81 rounded up): byte 118, 0.5 * 2^9 = 256
            block(448.0, -1.0),  # amax exactly 448 * 2^0: byte 127, reaches 448 (no clipping)
            block(449.0),  # just above: byte 128, 224.5 -> 224
            block(-448.0 * 32),  # -448 * 2^5: byte 132, code -448
            block(),  # all zero: byte 0, zero codes
        ],
        dtype=torch.float32,
    )  # [6, 32]
    q, s = mxfp8.quantize_activations(rows.reshape(2, 96))  # two tokens of H = 96: token-major [2, 3]
    assert s.dtype == torch.uint8 and s.shape == (2, 3) and q.dtype == torch.float8_e4m3fn
    assert s.reshape(-1).tolist() == [129, 118, 127, 128, 132, 0]
    c = codes(q).reshape(6, 32)
    assert c[0, :4].tolist() == [E4M3_CODE[0.25], E4M3_CODE[-0.75], 0x0D, E4M3_CODE[320.0]]  # 0x0D: 13/512
    assert c[1].tolist() == [E4M3_CODE[256.0]] * 32
    assert c[2, :2].tolist() == [E4M3_CODE[448.0], 0xB8]  # -1.0
    assert c[3, 0] == E4M3_CODE[224.0] and c[4, 0] == E4M3_CODE[-448.0]
    assert c[5].eq(0).all() and c[[0, 2, 3, 4], 4:].eq(0).all()
    deq = mxfp8.fake_quantize_activations(rows.reshape(2, 96)).reshape(6, 32)
    assert deq[0, :4].tolist() == [1.0, -3.0, 13 / 512 * 4, 1280.0]
    assert deq[3, 0] == 448.0 and deq[4, 0] == -448.0 * 32


def test_e4m3_subnormal_elements_round_to_nearest_even():
    # amax 448 -> byte 127 (scale 1): elements are cast as they are; e4m3 subnormals are multiples of 2^-9
    x = torch.tensor([block(448.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 2.0**-11)])
    q, s = mxfp8.quantize_activations(x)
    assert s.tolist() == [[127]]
    # 2^-10 is the tie between 0 and 2^-9 (even: 0); 3 * 2^-10 the tie between codes 1 and 2 (even: 2)
    assert codes(q)[0, :6].tolist() == [0x7E, 0x01, 0x00, 0x01, 0x02, 0x00]


def test_tiny_blocks_flush_to_zero_unlike_the_weight_rule():
    """Byte 0 (amax <= 448 * 2^-127): FlashInfer's inverse scale is 0, so the elements are 0; the weight
    rule (quantize) scales by 2^127 instead. Byte 1 and above are the same in both."""
    edge = 448.0 * 2.0**-127  # = 1.75 * 2^-118, a normal fp32 (and bf16) value
    x = torch.tensor([block(edge, -edge / 2), block(2.0**-117, 2.0**-118)])
    q, s = mxfp8.quantize_activations(x.reshape(1, 64))
    assert s.tolist() == [[0, 2]]  # 2^-117 / 448 = 2^-125.8 -> 2^-125: byte 2
    c = codes(q).reshape(2, 32)
    assert c[0].eq(0).all()
    assert c[1, :2].tolist() == [E4M3_CODE[256.0], 0x70]  # 2^-117 * 2^125 = 256, 2^-118 -> 128
    qw, sw = mxfp8.quantize(x.reshape(1, 64))
    assert torch.equal(sw, s) and codes(qw)[0, :2].tolist() == [E4M3_CODE[448.0], 0xF6]  # 448, -224
    assert torch.equal(codes(qw)[0, 32:], codes(q)[0, 32:])


def test_nonfinite_blocks_become_nan_blocks_others_untouched():
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(0))
    clean_q, clean_s = mxfp8.quantize_activations(x)
    x[0, 3], x[1, 70] = float("nan"), float("-inf")
    q, s = mxfp8.quantize_activations(x)
    assert s[0, 0] == 255 and s[1, 2] == 255
    assert codes(q)[0, :32].eq(0x7F).all() and codes(q)[1, 64:].eq(0x7F).all()
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 0] = keep[1, 2] = False
    assert torch.equal(s[keep], clean_s[keep])
    deq = mxfp8.fake_quantize_activations(x).reshape(2, 3, 32)
    assert deq[0, 0].isnan().all() and deq[1, 2].isnan().all() and deq[keep].isfinite().all()


def test_k_not_multiple_of_32_is_refused():
    with pytest.raises(mxfp8.MXFP8Error, match="moe hidden_states.*multiple of 32"):
        mxfp8.quantize_activations(torch.zeros(2, 48), name="moe hidden_states")


def _flashinfer_reference_bytes(amax: torch.Tensor, by_reciprocal: bool = False) -> torch.Tensor:
    """FlashInfer's test reference scale byte, transcribed (see the module docstring); by_reciprocal: the
    quotient as its kernels form it, amax * fl(1/448) (cute-dsl `INV_FLOAT8_E4M3_MAX`, host
    `1.f / 448.0f`)."""
    d = (amax * torch.tensor(1 / 448.0) if by_reciprocal else amax / 448.0).view(torch.int32)
    exp, man = (d >> 23) & 0xFF, d & 0x7FFFFF
    up = (man != 0) & ((exp != 0) | (man > 0x400000))
    return torch.where(amax > 0, (exp + up.int()).clamp(max=254), 0)


def _amax_blocks(amax: torch.Tensor, dtype) -> torch.Tensor:
    x = torch.zeros(amax.numel(), 32, dtype=dtype)
    x[:, 7] = amax.to(dtype)
    x[:, 8] = -amax.to(dtype) / 3  # a second, smaller element of the other sign
    return x


def test_scale_byte_equals_flashinfer_rule_for_every_bf16_amax():
    """Exhaustive: every positive finite bf16 value as a block's amax (normal and subnormal)."""
    amax = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16)  # [32639]
    _, s = mxfp8.quantize_activations(_amax_blocks(amax, torch.bfloat16))
    for by_reciprocal in (False, True):
        assert torch.equal(s[:, 0].int(), _flashinfer_reference_bytes(amax.float(), by_reciprocal))


def test_scale_byte_equals_flashinfer_rule_near_every_fp32_tie():
    """fp32 amax within 300 ulps of 448 * 2^k for every k with a normal amax, where a rounded amax / 448
    could pick a different power of two than the exact rule (amax / 448 is an fp32 subnormal for k < -126)."""
    ties = torch.tensor([448.0 * 2.0**k for k in range(-134, 119)]).view(torch.int32)  # [253]
    amax = (ties[:, None] + torch.arange(-300, 301, dtype=torch.int32)).reshape(-1).view(torch.float32)
    _, s = mxfp8.quantize_activations(_amax_blocks(amax, torch.float32))
    for by_reciprocal in (False, True):
        assert torch.equal(s[:, 0].int(), _flashinfer_reference_bytes(amax, by_reciprocal))


def test_same_bytes_as_the_weight_rule_on_ordinary_data():
    """Random, outlier and wide-range blocks: scale bytes and codes equal quantize()'s (byte 0 never
    occurs), for bf16 and fp32 alike."""
    g = torch.Generator().manual_seed(1)
    mags = 2.0 ** torch.randint(-20, 20, (64, 16, 1), generator=g).float()  # one magnitude per block
    x = (torch.randn(64, 16, 32, generator=g) * mags).reshape(64, 512)
    x[::7, 5] = 3e4  # outliers
    for dtype in (torch.float32, torch.bfloat16):
        q, s = mxfp8.quantize_activations(x.to(dtype))
        qw, sw = mxfp8.quantize(x.to(dtype))
        assert torch.equal(s, sw) and torch.equal(codes(q), codes(qw))
