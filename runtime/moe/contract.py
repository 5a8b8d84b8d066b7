"""The MoE contract: the only things a backend ever sees (weights, scales, SwiGLU-OAI and routing), and
the error a backend raises when it cannot run here.

Routing (`MoeRouting`): router logits = x @ router_weight^T (+ router_bias), fp32; `method`
(`RoutingMethod`) says how logits become the top-k expert ids and their weights; the weights are scaled
by routed_scaling_factor exactly once (by the backend). Each backend maps the method to its own routing
(the TRT-LLM backend to FlashInfer's RoutingMethodType) or refuses it with BackendUnavailable.

Canonical tensors (what `porter convert` writes; docs/moe-backends.md, docs/artifact-format.md):
  w13_weight        [E, 2I, H] float8_e4m3fn, uninterleaved [gate; up] rows
  w13_weight_scale  [E, 2I, H/32] uint8 UE8M0 (row r <-> weight row r)
  w2_weight         [E, H, I]  float8_e4m3fn
  w2_weight_scale   [E, H, I/32] uint8
  w13_bias          [E, 2I] float32 or None (expert biases): added to GEMM1's [gate; up] output before SwiGLU-OAI
  w2_bias           [E, H] float32 or None: added to GEMM2's output before the routing weight multiplies it
With `--quantize none` the weights are bf16/fp32 and both scales are None (torch backend only).
Backend-specific layouts (TRT-LLM's [up; gate] + shuffles, ...) are made inside that backend at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from porter.errors import BackendUnavailable, MoeNumericsError
from porter.format import mxfp8

TRTLLM_CAPABILITIES = ((10, 0), (10, 3), (10, 7))  # the SM versions flashinfer's TRT-LLM MoE kernels ship for


@dataclass(frozen=True)
class MoeQuantInfo:
    w13_weight: torch.Tensor  # [E, 2I, H] [gate; up]
    w13_weight_scale: Optional[torch.Tensor]  # [E, 2I, H/32] uint8, or None if not quantized
    w2_weight: torch.Tensor  # [E, H, I]
    w2_weight_scale: Optional[torch.Tensor]  # [E, H, I/32] uint8, or None
    # SwiGLU-OAI parameters per expert, fp32 [E] on the layer's device, materialized once at load.
    gemm1_alpha: torch.Tensor
    gemm1_beta: torch.Tensor
    gemm1_clamp_limit: torch.Tensor
    # Optional per-expert biases, fp32 on the layer's device: fp32 is what FlashInfer's TRT-LLM
    # MoE takes (gemm1_bias / gemm2_bias), holds the release's bf16 values exactly, and is what the kernels'
    # fp32 epilogues add. w13_bias rows follow w13's [gate; up] order.
    w13_bias: Optional[torch.Tensor] = None  # [E, 2I], added before the activation
    w2_bias: Optional[torch.Tensor] = None  # [E, H], added before the routing weight (so it is scaled by it)

    @property
    def num_experts(self) -> int:
        return self.w13_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_weight.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2_weight.shape[2]

    @property
    def is_mxfp8(self) -> bool:
        return self.w13_weight_scale is not None

    def validate(self) -> None:
        e, two_i, h = self.w13_weight.shape
        i = two_i // 2
        _expect(self.w2_weight, (e, h, i), "w2_weight")
        if self.is_mxfp8:
            _expect(self.w13_weight_scale, (e, two_i, h // 32), "w13_weight_scale", torch.uint8)
            _expect(self.w2_weight_scale, (e, h, i // 32), "w2_weight_scale", torch.uint8)
            if self.w13_weight.dtype != torch.float8_e4m3fn or self.w2_weight.dtype != torch.float8_e4m3fn:
                raise ValueError("MoeQuantInfo: MXFP8 weights must be float8_e4m3fn")
        elif self.w2_weight_scale is not None:
            raise ValueError("MoeQuantInfo: w2_weight_scale given without w13_weight_scale")
        for name in ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"):
            _expect(getattr(self, name), (e,), name, torch.float32)
            if getattr(self, name).device != self.w13_weight.device:
                raise ValueError(
                    f"MoeQuantInfo.{name} is on {getattr(self, name).device}, "
                    f"weights on {self.w13_weight.device}"
                )
        for name, shape in (("w13_bias", (e, two_i)), ("w2_bias", (e, h))):
            bias = getattr(self, name)
            if bias is None:
                continue
            _expect(bias, shape, name, torch.float32)
            if bias.device != self.w13_weight.device:
                raise ValueError(
                    f"MoeQuantInfo.{name} is on {bias.device}, weights on {self.w13_weight.device}"
                )


@dataclass(frozen=True)
class RoutingMethod:
    """How router logits [T, E] become (top-k ids, weights).

    scoring: "sigmoid" | "softmax", the score function;
    select: "scores" (top-k of the scores, plus e_score_correction_bias when there is one, the bias used
      for selection only) or "logits" (top-k of the logits, then the scores over the k chosen);
    renormalize: the chosen weights divided by their sum."""

    scoring: str
    select: str
    renormalize: bool

    def __post_init__(self):
        if self.scoring not in ("sigmoid", "softmax") or self.select not in ("scores", "logits"):
            raise ValueError(f"RoutingMethod: unknown scoring/select {self.scoring!r}/{self.select!r}")


# sigmoid scores; top-k of scores + e_score_correction_bias; the chosen (unbiased) scores renormalised
SIGMOID_BIAS_TOPK = RoutingMethod("sigmoid", "scores", renormalize=True)
# top-k of the logits, then a softmax over the k chosen
TOPK_SOFTMAX = RoutingMethod("softmax", "logits", renormalize=False)
# softmax over every expert, then top-k (renormalised or not)
SOFTMAX_TOPK = RoutingMethod("softmax", "scores", renormalize=False)
SOFTMAX_TOPK_RENORM = RoutingMethod("softmax", "scores", renormalize=True)


@dataclass(frozen=True)
class MoeRouting:
    """A layer's router and how it routes: `method` (default: sigmoid scores with a selection bias,
    renormalised), rsf applied once by the backend."""

    router_weight: torch.Tensor  # [E, H] fp32
    e_score_correction_bias: Optional[torch.Tensor]  # [E] fp32, for selection only; None: no bias
    top_k: int
    routed_scaling_factor: float
    method: RoutingMethod = SIGMOID_BIAS_TOPK
    router_bias: Optional[torch.Tensor] = None  # [E] fp32, added to the logits

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> fp32 router logits [T, E]."""
        logits = hidden_states.float() @ self.router_weight.float().t()
        return logits if self.router_bias is None else logits + self.router_bias.float()


def _expect(t, shape, name, dtype=None):
    if t is None or tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"MoeQuantInfo.{name}: expected shape {tuple(shape)}, got {None if t is None else tuple(t.shape)}"
        )
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"MoeQuantInfo.{name}: expected {dtype}, got {t.dtype}")


def make_swiglu_params(
    num_experts: int, alpha: float, beta: float, limit: float, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The per-expert fp32 [E] tensors, from the resolved config values (never hard-coded)."""
    full = lambda v: torch.full((num_experts,), float(v), dtype=torch.float32, device=device)
    return {"gemm1_alpha": full(alpha), "gemm1_beta": full(beta), "gemm1_clamp_limit": full(limit)}


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha, beta, limit) -> torch.Tensor:
    """gate * sigmoid(alpha * gate) * (up + beta), gate clamped above at limit, up to +-limit.

    alpha/beta/limit are floats or tensors broadcastable against gate (e.g. [n, 1] per row)."""
    gate = torch.minimum(gate, torch.as_tensor(limit, dtype=gate.dtype, device=gate.device))
    lim = torch.as_tensor(limit, dtype=up.dtype, device=up.device)
    up = torch.maximum(torch.minimum(up, lim), -lim)
    return gate * torch.sigmoid(alpha * gate) * (up + beta)


def route(hidden_states: torch.Tensor, routing: MoeRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32, by routing.method, without rsf)."""
    return select_experts(
        routing.logits(hidden_states), routing.e_score_correction_bias, routing.top_k, routing.method
    )


def select_experts(
    router_logits: torch.Tensor,
    bias: Optional[torch.Tensor],
    top_k: int,
    method: RoutingMethod = SIGMOID_BIAS_TOPK,
):
    """fp32 logits [T, E] -> (topk_ids [T, k] int64, weights [T, k] fp32), the reference of every method."""
    logits = router_logits.float()
    score = torch.sigmoid if method.scoring == "sigmoid" else lambda x: torch.softmax(x, dim=-1)
    if method.select == "logits":  # top-k of the logits, scores over the chosen k
        top_logits, topk_ids = torch.topk(logits, top_k, dim=-1)
        weights = score(top_logits)
    else:
        scores = score(logits)  # [T, E]
        choice = scores if bias is None else scores + bias.float()  # bias for selection only
        _, topk_ids = torch.topk(choice, top_k, dim=-1)
        weights = scores.gather(1, topk_ids)
    if method.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return topk_ids, weights


MOE_NUMERICS = ("w8a16", "serving")


def check_numerics_name(numerics) -> None:
    if numerics is not None and numerics not in MOE_NUMERICS:
        raise MoeNumericsError(
            f"unknown moe_numerics {numerics!r}; use one of {', '.join(MOE_NUMERICS)} "
            f"(or leave it unset for the backend's own)"
        )


def check_numerics(numerics, backend: str, quantized: bool = True) -> None:
    """Refuse a numerics choice the resolved backend does not compute (never a silent substitute)."""
    check_numerics_name(numerics)
    if numerics == "serving" and not quantized:
        raise MoeNumericsError(
            "moe_numerics='serving' needs MXFP8 experts (the serving kernel's weights); "
            "these are unquantized: convert with --quantize experts or use 'w8a16'"
        )
    if (
        numerics is None
        or backend in ("torch", "triton")
        or (backend, numerics) == ("flashinfer-trtllm", "serving")
    ):
        return
    raise BackendUnavailable(
        f"moe_numerics={numerics!r} is not what the {backend} MoE backend computes; "
        f"use backend='torch' or 'triton' for it, or leave moe_numerics unset"
    )


def serving_intermediate(act: torch.Tensor) -> torch.Tensor:
    """The SwiGLU output as the serving kernel's GEMM2 reads it: rounded to bf16, then MXFP8 (FlashInfer's
    reference of the TRT-LLM MoE, run_moe_dequant: mxfp8_quantize(act.to(bf16))), in act's dtype."""
    return mxfp8.fake_quantize_activations(act.to(torch.bfloat16), act.dtype, "moe intermediate")
