"""The MoE contract's routing and activation, on CPU: each RoutingMethod's reference (select_experts) against
formulas written here, its FlashInfer TRT-LLM routing_method_type, and plain SwiGLU (alpha 1, beta 0, no
clamp) reaching the TRT-LLM kernel as its defaults, with the kernel emulation equal to the torch backend.

Formulas: sigmoid + bias top-k (MiniMax2 in FlashInfer: RoutingCustomPolicy.cuh, SigmoidBias +
ScaledSumNormalize); top-k of the logits then a softmax over the k (FlashInfer Renormalize: TopK -> Softmax);
softmax then top-k (Default), then renormalised (RenormalizeNaive). Enum values: flashinfer-python
0.7.2.post1 (docs/moe-backends.md).
"""

from __future__ import annotations

import pytest
import torch
from test_trtllm_backend import REL_KERNEL, REL_TIGHT, E, H, I, emulate_kernel, make_layer, rel

from runtime.moe import BackendUnavailable
from runtime.moe import flashinfer_trtllm as fi_moe
from runtime.moe.contract import (
    SIGMOID_BIAS_TOPK,
    SOFTMAX_TOPK,
    SOFTMAX_TOPK_RENORM,
    TOPK_SOFTMAX,
    MoeRouting,
    RoutingMethod,
    make_swiglu_params,
    route,
    select_experts,
)
from runtime.moe.flashinfer_trtllm import TrtllmMoE
from runtime.moe.torch_backend import TorchMoE

flashinfer = pytest.importorskip("flashinfer")
from flashinfer import fused_moe as fim  # noqa: E402

K = 3


def logits_and_bias(seed=0, t=16, e=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=g) * 2, torch.randn(e, generator=g) * 0.5


def sorted_pairs(ids, w):
    """(ids, weights) sorted by id per row: selections compared as sets with their weights."""
    order = ids.argsort(-1)
    return ids.gather(1, order), w.gather(1, order)


def test_sigmoid_bias_topk_is_the_sigmoid_bias_formula():
    logits, bias = logits_and_bias()
    ids, w = select_experts(logits, bias, K, SIGMOID_BIAS_TOPK)
    s = 1 / (1 + torch.exp(-logits.double()))
    want_ids = (s + bias.double()).argsort(-1, descending=True)[:, :K]  # selection: biased scores
    want_w = s.gather(1, want_ids)
    want_w = want_w / want_w.sum(-1, keepdim=True)
    got, want = sorted_pairs(ids, w), sorted_pairs(want_ids, want_w)
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1].double(), want[1], rtol=1e-6, atol=0)
    # the bias selects but does not weigh: without it the choice differs on some row, the weights never
    # include it
    no_bias, _ = select_experts(logits, None, K, SIGMOID_BIAS_TOPK)
    assert not torch.equal(sorted_pairs(no_bias, w)[0], got[0])


def test_topk_softmax_is_a_softmax_over_the_chosen_logits():
    logits, _ = logits_and_bias(1)
    ids, w = select_experts(logits, None, K, TOPK_SOFTMAX)
    top = logits.double().topk(K, dim=-1)
    want = torch.exp(top.values) / torch.exp(top.values).sum(-1, keepdim=True)
    assert torch.equal(ids, top.indices) and torch.allclose(w.double(), want, rtol=1e-6, atol=0)
    # the same weights as a softmax over all experts renormalised over the same k (exact in reals)
    ids2, w2 = select_experts(logits, None, K, SOFTMAX_TOPK_RENORM)
    assert torch.equal(sorted_pairs(ids, w)[0], sorted_pairs(ids2, w2)[0])
    assert torch.allclose(sorted_pairs(ids, w)[1], sorted_pairs(ids2, w2)[1], rtol=1e-5, atol=0)
    # without renormalising, the softmax-first weights are the full softmax's (sum < 1)
    _, w3 = select_experts(logits, None, K, SOFTMAX_TOPK)
    assert bool((w3.sum(-1) < 1 - 1e-3).all())


def test_router_bias_enters_the_logits():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(5, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(6, generator=g)
    routing = MoeRouting(w, None, 2, 1.0, method=TOPK_SOFTMAX, router_bias=b)
    assert torch.allclose(routing.logits(x), x @ w.t() + b, rtol=1e-6, atol=1e-6)
    ids, weights = route(x, routing)
    assert torch.equal(ids, (x @ w.t() + b).topk(2, dim=-1).indices)


def test_routing_method_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown scoring"):
        RoutingMethod("relu", "scores", True)


@pytest.mark.parametrize(
    "method, bias, member, value",
    [
        (SIGMOID_BIAS_TOPK, True, "MiniMax2", 7),
        (SIGMOID_BIAS_TOPK, False, "MiniMax2", 7),
        (TOPK_SOFTMAX, False, "Renormalize", 1),
        (SOFTMAX_TOPK, False, "Default", 0),
        (SOFTMAX_TOPK_RENORM, False, "RenormalizeNaive", 4),
    ],
)
def test_trtllm_routing_method_type(method, bias, member, value):
    assert fi_moe.routing_method_name(method, bias) == member
    assert fi_moe.routing_method_type(method, bias) == int(getattr(fim.RoutingMethodType, member)) == value


def test_trtllm_refuses_a_routing_it_has_not():
    with pytest.raises(BackendUnavailable, match="no routing method .* with a selection bias"):
        fi_moe.routing_method_name(TOPK_SOFTMAX, True)
    with pytest.raises(BackendUnavailable, match="no routing method"):
        fi_moe.routing_method_name(RoutingMethod("sigmoid", "logits", False), False)
    quant, routing, _ = make_layer()
    bad = MoeRouting(routing.router_weight, routing.e_score_correction_bias, 2, 1.0, method=TOPK_SOFTMAX)
    with pytest.raises(BackendUnavailable):  # at load, before any call
        TrtllmMoE(quant, bad)


def test_trtllm_kwargs_of_topk_softmax_routing():
    quant, routing, hidden = make_layer()
    gpt_style = MoeRouting(routing.router_weight, None, 2, 1.0, method=TOPK_SOFTMAX)
    kw = TrtllmMoE(quant, gpt_style).kernel_kwargs(hidden)
    assert kw["routing_method_type"] == fim.RoutingMethodType.Renormalize and kw["routing_bias"] is None
    assert torch.equal(kw["routing_logits"], hidden.float() @ routing.router_weight.float().t())
    # a sigmoid routing without a bias still hands MiniMax2 a bias: zeros, which select alike
    kw = TrtllmMoE(quant, MoeRouting(routing.router_weight, None, 2, 1.0)).kernel_kwargs(hidden)
    assert kw["routing_method_type"] == fim.RoutingMethodType.MiniMax2
    assert torch.equal(kw["routing_bias"], torch.zeros(E))


def plain_swiglu_layer(seed=0):
    """A layer with plain SwiGLU (silu(gate) * up): alpha 1, beta 0, no clamp (limit +inf)."""
    return make_layer(seed, swiglu=make_swiglu_params(E, 1.0, 0.0, float("inf"), "cpu"))


def test_plain_swiglu_reaches_the_kernel_as_its_defaults():
    """An infinite limit is passed as None (the kernel's "no clamp"); alpha 1 and beta 0 as tensors."""
    quant, routing, hidden = plain_swiglu_layer()
    kw = TrtllmMoE(quant, routing).kernel_kwargs(hidden)
    assert kw["gemm1_clamp_limit"] is None
    assert torch.equal(kw["gemm1_alpha"], torch.ones(E)) and torch.equal(kw["gemm1_beta"], torch.zeros(E))
    # a finite limit is passed through
    kw = TrtllmMoE(*make_layer()[:2]).kernel_kwargs(hidden)
    assert torch.equal(kw["gemm1_clamp_limit"], torch.full((E,), 7.0))


def test_plain_swiglu_emulated_kernel_equals_torch_backend():
    """The kernel's documented math with the defaults (no clamp) on the prepared tensors == TorchMoE with
    alpha 1 / beta 0 / limit inf == silu(gate) * up written here, on the same quantized activations."""
    quant, routing, hidden = plain_swiglu_layer(1)
    backend = TrtllmMoE(quant, routing)
    ids, weights = route(hidden, routing)
    from porter.format import mxfp8

    x = mxfp8.fake_quantize(hidden)
    emulated = emulate_kernel(
        backend.routed_kernel_kwargs(hidden, ids, weights),
        quantize_intermediate=False,
        out_dtype=torch.float32,
    )
    torch_out = TorchMoE(quant, routing).forward_topk(x, ids, weights)
    assert rel(emulated, torch_out) <= REL_TIGHT
    w13 = mxfp8.dequantize(quant.w13_weight, quant.w13_weight_scale)  # [E, 2I, H]
    w2 = mxfp8.dequantize(quant.w2_weight, quant.w2_weight_scale)  # [E, H, I]
    want = torch.zeros(hidden.shape[0], H)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t]
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            want[t] += weights[t, j] * (w2[e] @ act)
    assert rel(torch_out, want * routing.routed_scaling_factor) <= 1e-5
    full = emulate_kernel(backend.kernel_kwargs(hidden))  # the logits path, MXFP8 intermediate, bf16 out
    assert rel(full, TorchMoE(quant, routing)(hidden)) <= REL_KERNEL
