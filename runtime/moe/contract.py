"""The MoE contract: the only things a backend ever sees (weights, scales, SwiGLU-OAI and routing), and
the error a backend raises when it cannot run here.

Canonical tensors (what `porter convert` writes; docs/moe-backends.md, docs/artifact-format.md):
  w13_weight        [E, 2I, H] float8_e4m3fn, uninterleaved [gate; up] rows
  w13_weight_scale  [E, 2I, H/32] uint8 UE8M0 (row r <-> weight row r)
  w2_weight         [E, H, I]  float8_e4m3fn
  w2_weight_scale   [E, H, I/32] uint8
  w13_bias          [E, 2I] float32 or None (gpt-oss): added to GEMM1's [gate; up] output before SwiGLU-OAI
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
    # Optional per-expert biases (gpt-oss), fp32 on the layer's device: fp32 is what FlashInfer's TRT-LLM
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
class MoeRouting:
    """MiniMax-M3 routing: sigmoid scores, bias for selection only, renormalised top-k, rsf once."""

    router_weight: torch.Tensor  # [E, H] fp32
    e_score_correction_bias: torch.Tensor  # [E] fp32
    top_k: int
    routed_scaling_factor: float


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
    """hidden [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32, renormalised, without rsf)."""
    logits = hidden_states.float() @ routing.router_weight.float().t()  # [T, E]
    return select_experts(logits, routing.e_score_correction_bias, routing.top_k)


def select_experts(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int):
    scores = torch.sigmoid(router_logits.float())  # [T, E]
    _, topk_ids = torch.topk(scores + bias.float(), top_k, dim=-1)  # bias for selection only
    weights = scores.gather(1, topk_ids)
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
