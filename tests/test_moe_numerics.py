"""runtime.load(..., moe_numerics=): "w8a16" (the torch reference's default) or "serving" (MXFP8 layer input
and SwiGLU output, as the TRT-LLM kernel computes; docs/moe-backends.md "Serving numerics"), carried to
every MoE layer's torch backend; bad values and impossible pairs refused in one line. The serving math
itself is proven against the kernel emulation in tests/test_trtllm_backend.py."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import torch

import runtime
from porter import convert
from porter.errors import MoeNumericsError, PorterError
from porter.format import mxfp8
from runtime.moe import BackendUnavailable, check_numerics
from runtime.moe.contract import MoeQuantInfo, MoeRouting, make_swiglu_params
from runtime.moe.torch_backend import TorchMoE

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def art(tmp_path_factory, tiny_vendor):
    out = tmp_path_factory.mktemp("numerics") / "mxfp8"
    convert(tiny_vendor, out, quantize="experts", progress=False)
    return out


def moe_backends(model):
    return [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]


def test_unknown_value_is_refused_before_anything_is_opened(tmp_path):
    with pytest.raises(MoeNumericsError) as err:
        runtime.load(tmp_path / "does-not-exist", moe_numerics="fp8")
    msg = str(err.value)
    assert isinstance(err.value, PorterError) and "\n" not in msg
    assert "'fp8'" in msg and "w8a16" in msg and "serving" in msg


def test_serving_needs_mxfp8_experts(tiny_vendor):
    with pytest.raises(MoeNumericsError, match="needs MXFP8 experts.*unquantized"):
        runtime.load(tiny_vendor, moe_numerics="serving")


def test_backend_pairs():
    check_numerics(None, "triton")
    check_numerics("serving", "flashinfer-trtllm")  # what that kernel computes
    for numerics in ("w8a16", "serving"):
        check_numerics(numerics, "torch")
        check_numerics(numerics, "triton")
    for numerics, backend in (("w8a16", "flashinfer-trtllm"),):
        expected = f"moe_numerics='{numerics}'.*{backend}.*backend='torch' or 'triton'"
        with pytest.raises(BackendUnavailable, match=expected):
            check_numerics(numerics, backend)
    quant, routing = _small_layer()
    with pytest.raises(MoeNumericsError, match="'w8a8'"):
        TorchMoE(quant, routing, numerics="w8a8")
    plain = fx.dequantized(quant)
    with pytest.raises(MoeNumericsError, match="unquantized"):
        TorchMoE(plain, routing, numerics="serving")


def _small_layer(e=4, h=64, i=64):
    g = torch.Generator().manual_seed(0)
    w13 = mxfp8.quantize(torch.randn(e, 2 * i, h, generator=g) * h**-0.5)
    w2 = mxfp8.quantize(torch.randn(e, h, i, generator=g) * i**-0.5)
    quant = MoeQuantInfo(*w13, *w2, **make_swiglu_params(e, 1.702, 1.0, 7.0, "cpu"))
    return quant, MoeRouting(torch.randn(e, h, generator=g), torch.zeros(e), 2, 2.0)


def test_serving_reaches_every_moe_layer_and_changes_the_logits(art):
    ids = fx.prompt(fx.SHORT)
    default = runtime.load(art)
    w8a16 = runtime.load(art, moe_numerics="w8a16")
    serving = runtime.load(art, moe_numerics="serving")
    assert [m.numerics for m in moe_backends(default)] == ["w8a16"] * 3
    assert [m.numerics for m in moe_backends(serving)] == ["serving"] * 3
    with torch.no_grad():
        base, same, served = default(ids), w8a16(ids), serving(ids)
    assert torch.equal(base, same)
    err = fx.rel(served, base)
    # measured 4.0e-2: MXFP8 activations in three MoE layers of a tiny random model, which amplifies any
    # perturbation (its MXFP8 weights alone move these logits 18 % from the source's)
    assert 1e-2 <= err <= 1e-1, err


@pytest.fixture(scope="module")
def art_all(tmp_path_factory, tiny_vendor):
    out = tmp_path_factory.mktemp("numerics-all") / "mxfp8"
    convert(tiny_vendor, out, quantize="all", progress=False)
    return out


def test_serving_rounds_the_inputs_of_mxfp8_linears(art_all, art):
    """In the serving numerics every MXFP8 linear (`--quantize all`) multiplies its input rounded to MXFP8
    along K, as the engines' W8A8 MXFP8 linear: o_proj equals the closed form F.linear(fake_quant(x),
    dequant(W)) to fp32 summation order, and w8a16 keeps x as given. With `--quantize experts` no linear is
    MXFP8, so the flag changes nothing there."""
    w8a16, serving = runtime.load(art_all), runtime.load(art_all, moe_numerics="serving")
    quantized = [lin for layer in serving.layers for lin in layer.linears() if lin.scale is not None]
    assert quantized and all(lin.mxfp8_act for lin in quantized)
    assert not any(lin.mxfp8_act for layer in w8a16.layers for lin in layer.linears())
    lin = serving.layers[1].self_attn.o_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, lin.weight.shape[1], generator=g) * torch.logspace(
        -3, 3, lin.weight.shape[1] // 32
    ).repeat_interleave(32)
    w = mxfp8.dequantize(lin.weight, lin.scale, torch.float32)  # [N, K]
    want = torch.nn.functional.linear(mxfp8.fake_quantize_activations(x), w)
    assert fx.rel(lin(x), want) <= 1e-6
    plain = w8a16.layers[1].self_attn.o_proj(x)
    assert fx.rel(plain, torch.nn.functional.linear(x, w)) <= 1e-6
    assert fx.rel(lin(x), plain) >= 1e-2  # the activation rounding is visible (4 significant bits)
    ids = fx.prompt(fx.SHORT)
    with torch.no_grad():
        moe_only = runtime.load(art, moe_numerics="serving")
        assert not any(lin.scale is not None for layer in moe_only.layers for lin in layer.linears())
        err = fx.rel(serving(ids), w8a16(ids))
    # the MoE rounding alone moves the tiny model's logits 4.0e-2 (above); with every linear as well, more
    assert 2e-2 <= err <= 3e-1, err


@pytest.mark.parametrize("lazy", [False, True])
def test_set_numerics_equals_loading_with_them(art_all, lazy):
    """runtime.set_numerics switches a loaded model (`--quantize all`: MXFP8 linears and experts) to what
    runtime.load(moe_numerics=) gives, bit for bit, both ways and back; a layer-streaming model too, whose
    resident layer changes in place and whose later layers are built in the new numerics."""
    ids = fx.prompt(fx.SHORT)
    want = {n: runtime.load(art_all, lazy=lazy, moe_numerics=n)(ids) for n in ("w8a16", "serving")}
    assert fx.rel(want["serving"], want["w8a16"]) >= 1e-2  # a switch that did nothing would show
    model = runtime.load(art_all, lazy=lazy, moe_numerics="w8a16")
    model(ids)  # lazy: the last layer stays resident across the switch
    for numerics in ("serving", "w8a16", "serving", None):
        runtime.set_numerics(model, numerics)
        assert torch.equal(model(ids), want[numerics or "w8a16"]), numerics  # None: the backend's own


def test_set_numerics_refuses_what_the_backend_cannot_compute(tiny_vendor):
    """The rule runtime.load applies (check_numerics), in one line; a refused switch changes nothing."""
    model = runtime.load(tiny_vendor)  # the bf16 source: unquantized experts
    with pytest.raises(MoeNumericsError, match="needs MXFP8 experts.*unquantized") as err:
        runtime.set_numerics(model, "serving")
    assert "\n" not in str(err.value) and model.numerics.moe is None
    with pytest.raises(MoeNumericsError, match="'fp8'"):
        runtime.set_numerics(model, "fp8")
    assert [m.numerics for m in moe_backends(model)] == ["w8a16"] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_serving_decode_path_equals_the_reference_loop(dtype):
    """At decode sizes (T*k <= E) the torch backend's serving numerics run batched per routed slot with no
    host sync (so a decode step can be captured); they equal the per-expert loop to fp32 summation order."""
    quant, routing = _small_layer(e=8)
    moe = TorchMoE(quant, routing, numerics="serving")
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 64, generator=g) * torch.tensor([1.0, 30.0, 0.01])[:, None]).to(dtype)
    ids = torch.tensor([[0, 5], [5, 7], [2, 3]])
    w = torch.rand(3, 2, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True)
    fast = moe.forward_topk(x, ids, w)  # 6 slots <= 8 experts: the batched path
    loop = moe._forward_looped(x, ids, w, serving=True)
    assert fast.dtype == dtype and fx.rel(fast, loop) <= (1e-6 if dtype == torch.float32 else 8e-3)
    assert fx.rel(fast, TorchMoE(quant, routing).forward_topk(x, ids, w)) >= 1e-2  # not the w8a16 numerics
