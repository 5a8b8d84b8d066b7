"""porter.format.mxfp8.quantize_activations against the engines' own torch MXFP8 activation quantizers, bit for bit
(CPU): vLLM 0.33.0 `_mxfp8_e4m3_quantize_torch` (vllm/model_executor/layers/quantization/utils/mxfp8_utils.py,
the fallback of vLLM's `mxfp8_e4m3_quantize` where FlashInfer's kernel is not available) and sglang 0.5.23
`_mxfp8_e4m3_quantize_torch` (sglang/kernels/ops/quantization/mxfp8_amd_gfx95.py, its reference quantizer).
Both compute byte = clamp(ceil(log2(max(amax, 2^-126) / 448)) + 127, 0, 254) and cast x / 2^(byte - 127)
to e4m3 (sglang clamps to +-448 first). docs/moe-backends.md, "Serving numerics".

Equal: every scale byte, and every element of every block whose byte is not 0. Byte-0 blocks (amax <=
448 * 2^-127, e.g. all-zero ones) differ by design: FlashInfer's kernels and its reference write zero
elements there (inverse scale 0), the engines' torch fallbacks scale by 2^127 (exactly porter's weight
rule, mxfp8.quantize, which is asserted too).
"""

import pytest
import torch
from sglang.kernels.ops.quantization.mxfp8_amd_gfx95 import _mxfp8_e4m3_quantize_torch as sglang_quantize
from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
    _mxfp8_e4m3_quantize_torch as vllm_quantize,
)

from porter.format import mxfp8

ENGINES = {"vllm": vllm_quantize, "sglang": sglang_quantize}
K = 256  # 8 blocks per row


def _blocks(gen, rows, scale_lo, scale_hi):
    """[rows, K] bf16-representable values, one random power-of-two magnitude per 32-block."""
    mags = 2.0 ** torch.randint(scale_lo, scale_hi, (rows, K // 32, 1), generator=gen).float()
    return (torch.randn(rows, K // 32, 32, generator=gen) * mags).reshape(rows, K)


def cases() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {"random": _blocks(g, 256, -30, 30)}
    x = _blocks(g, 128, -4, 4)
    x[torch.arange(128), torch.randint(0, K, (128,), generator=g)] *= 3e3  # one outlier per row
    out["outlier"] = x
    # e4m3 subnormals (elements below 2^-6 of the scale) and bf16/fp32 subnormals (below 2^-126)
    x = _blocks(g, 64, -14, 0)
    x[:, 1::3] *= 2.0**-12
    y = _blocks(g, 64, -120, -112)
    y[:, 2::4] = torch.randn(64, K // 4, generator=g) * 2.0**-130
    out["subnormal"] = torch.cat([x, y])
    # byte 0 and byte 1: amax <= 448 * 2^-127 and just above it (all-zero blocks included)
    x = torch.randn(32, K, generator=g) * 2.0 ** torch.randint(-134, -116, (32, 1), generator=g).float()
    x[::3, :64] = 0
    out["tiny_and_zero"] = x
    # amax exactly 448 * 2^k (the block reaches +-448), bf16's largest finite values, values that round up
    # to 448
    ks = torch.arange(-40, 40)
    x = torch.randn(ks.numel(), K, generator=g).clamp(-1, 1) * 200.0 * 2.0 ** ks[:, None].float()
    x[:, ::32] = 448.0 * 2.0 ** ks[:, None].float() * torch.where(ks[:, None] % 2 == 0, 1.0, -1.0)
    x[0] = torch.finfo(torch.bfloat16).max * torch.linspace(-1, 1, K)
    x[1, ::32] = 447.0
    out["saturating"] = x
    return {name: v.to(torch.bfloat16) for name, v in out.items()}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("case", ["random", "outlier", "subnormal", "tiny_and_zero", "saturating"])
def test_bit_identical_to_engine(engine, case):
    x = cases()[case]
    q_e, s_e = ENGINES[engine](x)
    q, s = mxfp8.quantize_activations(x)
    assert s_e.dtype == torch.uint8 and s_e.shape == s.shape == (x.shape[0], K // 32)
    assert torch.equal(s_e, s)
    codes_e = q_e.view(torch.uint8).reshape(*s.shape, 32)
    codes = q.view(torch.uint8).reshape(*s.shape, 32)
    kept = s != 0
    assert torch.equal(codes_e[kept], codes[kept])
    assert codes[~kept].eq(0).all()  # FlashInfer's flush of byte-0 blocks
    weight_codes = mxfp8.quantize(x)[0].view(torch.uint8).reshape(*s.shape, 32)
    assert torch.equal(codes_e, weight_codes)  # the engines' fallback == porter's weight rule, everywhere
    if case == "tiny_and_zero":  # the byte-0 difference is exercised, with nonzero engine codes
        assert (~kept).any() and codes_e[~kept].ne(0).any() and (s == 1).any()
    if case == "saturating":  # blocks reach +-448 exactly
        assert (codes & 0x7F).eq(0x7E).sum() >= 80


@pytest.mark.parametrize("engine", list(ENGINES))
def test_fp32_input_bit_identical_away_from_ties(engine):
    """fp32 activations (the SwiGLU output before the FC1 epilogue's quantization) with random mantissas:
    no amax within a few ulps of 448 * 2^k, where the engines' float log2 can round the other way."""
    x = _blocks(torch.Generator().manual_seed(5), 256, -30, 30)
    q_e, s_e = ENGINES[engine](x)
    q, s = mxfp8.quantize_activations(x)
    assert torch.equal(s_e, s) and torch.equal(q_e.view(torch.uint8), q.view(torch.uint8))
