"""Faithfulness of `porter verify`: the converted model against the rounded reference (rounded.py), piece by
piece on the same input, within what float rounding can produce — the limit below, not a tuned number.

Each decoder layer runs alone in both models on the same hidden state h (the bf16 source's), and
    faith_error = ||out_conv - out_rounded|| / ||d||,   d = out_rounded - h (the layer's update).
The embedding output and the final logits (final norm + lm_head on the same h) are compared relative to
their own norm. Both models hold the same MXFP8 values when the conversion is faithful, so what is left
is the order and precision in which the two computations round; docs/verify.md ("Faithfulness") derives:

    u      the unit roundoff of the coarsest float format either computation rounds to: the compute dtype's
           (2^-24 float32, 2^-8 bfloat16), or bfloat16's where the converted model's MoE kernel takes
           bf16 operands (KERNEL_OPERANDS), whatever the dtype.
    K = 4  the points where two correct MoE computations may round differently (GEMM1 output, SwiGLU output,
           GEMM2 output, the weighted sum of the experts), each within u relative: before the layer output
           is rounded they differ by ||delta|| <= K u ||d||.
    output rounding: the residual stream out = h + d is rounded to a grid of spacing <= 2u|out|; where the
           two values straddle a grid point the difference becomes a whole step, so
           ||Delta||^2 <= ||delta||^2 + ||delta|| 2u ||out||  ->
    limit  = K u sqrt(1 + (2 / K) ||out|| / ||d||)   per layer, K u for the embeddings and the logits.

Attention, norms, the router and the dense MLPs run the same code on the same values in both models, so
they contribute nothing beyond this (a route decided differently would: it cannot be, since the router
input is the same). A layout, parameter or runtime bug changes the update by far more than u.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

K = 4  # rounding points of the MoE block where two correct computations may differ (module docstring)
# The float format the converted model's MoE kernels round their operands to, whatever the model dtype:
# porter's Triton kernel multiplies bf16 (or, exactly rescaled, fp16) operands with fp32 accumulation and
# stores the SwiGLU output as bf16 (runtime/moe/triton/kernels.py); FlashInfer's TRT-LLM kernel reads bf16
# inputs. The torch backend computes in the model's dtype.
KERNEL_OPERANDS = {"triton": torch.bfloat16, "flashinfer-trtllm": torch.bfloat16}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of `dtype`'s floats just above 1: the largest relative error of rounding to it."""
    return torch.finfo(dtype).eps / 2


def precision(dtype: torch.dtype, moe_backend: Optional[str]) -> torch.dtype:
    """The coarsest float format of a layer computed in `dtype` whose MoE runs on `moe_backend` (None: no
    MoE in the layer)."""
    formats = [dtype] + ([KERNEL_OPERANDS[moe_backend]] if moe_backend in KERNEL_OPERANDS else [])
    return max(formats, key=unit_roundoff)


def limit(u: float, out_over_d: Optional[float] = None) -> float:
    """The largest faith_error float rounding explains: K u sqrt(1 + (2 / K) ||out|| / ||d||) for a layer
    (out_over_d = ||out|| / ||d||), K u for a piece without a residual (None)."""
    if out_over_d is None:
        return K * u
    return K * u * math.sqrt(1 + (2 / K) * out_over_d)


class Gap:
    """Running sums over sequences of ||out_conv - out_rounded||^2, ||d||^2 and ||out||^2 (float64)."""

    def __init__(self):
        self.diff = self.update = self.out = 0.0

    def add(self, conv: torch.Tensor, rounded: torch.Tensor, base: Optional[torch.Tensor] = None) -> None:
        """conv, rounded: the two outputs; base: the layer's input h (None: the output itself is compared)."""
        c, r = conv.double(), rounded.to(conv.device).double()
        self.diff += float((c - r).square().sum())
        self.out += float(r.square().sum())
        self.update += float((r - base.to(r.device).double()).square().sum()) if base is not None else 0.0

    def error(self, residual: bool = True) -> float:
        """||Delta|| / ||d|| (a layer) or / ||out|| (residual False): 0 when equal, inf over a zero base."""
        base = self.update if residual else self.out
        if self.diff == 0:
            return 0.0
        return math.sqrt(self.diff / base) if base > 0 else math.inf

    def limit(self, u: float, residual: bool = True) -> float:
        if not residual:
            return limit(u)
        if self.update == 0:  # no update: only an exact match passes (error 0, or inf)
            return limit(u, 0.0)
        return limit(u, math.sqrt(self.out / self.update))


def moe_backend(layer) -> Optional[str]:
    """The MoE backend name of a runtime decoder layer (None for a dense layer)."""
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    return getattr(experts, "name", None)
