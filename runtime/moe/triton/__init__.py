"""Hopper (SM90; runs on SM80+) MoE backend: Triton MXFP8 fused MoE reading the canonical tensors.

config (tile tables, named kernel modes) -> prepare (load-time guards and rebase) -> launch (path choice
and launches) -> kernels (Triton; imported on first launch, so this package imports without triton).
"""

from __future__ import annotations

import importlib.util

import torch

from runtime.moe.contract import (
    BackendUnavailable,
    MoeQuantInfo,
    MoeRouting,
    check_numerics,
    route,
)
from runtime.moe.triton.config import MoeConfig
from runtime.moe.triton.launch import fused_moe
from runtime.moe.triton.prepare import prepare as prepare_weights


class TritonMoE:
    """fp8_prefill: prefill of FP8_PREFILL_MIN_TOKENS+ tokens with e4m3 activations and fp8 MMAs (SM89+;
    faster, layer error vs the torch reference about 6e-3 instead of 4e-3; docs/moe-backends.md).
    rebase: keep the experts rebased to one power-of-two scale per row where that is exact enough
    (prepare); False keeps the stored MXFP8 layout.
    numerics: "w8a16" (activations as given) or "serving": the input and the SwiGLU output rounded inside the
    kernels to the MXFP8 values the TRT-LLM kernel computes (contract.serving_intermediate, bit for bit),
    then the GEMMs on those values (W8A16; with fp8_prefill, one e4m3 term per row on the FP8 path)."""

    name = "triton"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable(
                f"triton MoE backend needs a CUDA device with capability >= 8.0 "
                f"(SM80+); got device type {device.type!r}"
            )
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "triton MoE backend needs CUDA (capability >= 8.0), but torch.cuda.is_available() is False"
            )
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            raise BackendUnavailable(
                f"triton MoE backend needs compute capability >= 8.0 (SM80+); "
                f"{torch.cuda.get_device_name(device)} is SM{cap[0]}{cap[1]}"
            )
        if importlib.util.find_spec("triton") is None:
            raise BackendUnavailable(
                "triton MoE backend needs the 'triton' package (capability "
                f"SM{cap[0]}{cap[1]} is fine); pip install triton"
            )

    def __init__(
        self,
        quant: MoeQuantInfo,
        routing: MoeRouting,
        *,
        fp8_prefill: bool = True,
        rebase: bool = True,
        numerics: str = "w8a16",
    ):
        quant.validate()
        check_numerics(numerics, self.name, quant.is_mxfp8)
        self.numerics = numerics or "w8a16"
        if not quant.is_mxfp8:
            raise BackendUnavailable(
                "triton MoE backend runs MXFP8 weights only (float8_e4m3fn + uint8 "
                "UE8M0 scales); these weights are unquantized: use backend='torch'"
            )
        self.check_supported(quant.w13_weight.device)
        self.routing, self.fp8_prefill = routing, fp8_prefill
        self.prepared = prepare_weights(
            quant.w13_weight,
            quant.w13_weight_scale,
            quant.w2_weight,
            quant.w2_weight_scale,
            quant.gemm1_alpha,
            quant.gemm1_beta,
            quant.gemm1_clamp_limit,
            quant.w13_bias,
            quant.w2_bias,
            rebase=rebase,
        )
        # Rebased at load, the backend holds its own copy of the experts: it keeps no reference to the
        # MXFP8 tensors (quant None), so a caller that drops its own has each layer's experts resident once.
        self.quant = None if self.prepared.rebased else quant

    @property
    def replaced_weights(self) -> bool:
        """Whether the backend's layout replaced the canonical tensors (rebased at load)."""
        return self.prepared.rebased

    def forward_topk(self, hidden_states, topk_ids, topk_weights, config: MoeConfig | None = None):
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] (renormalised) -> routed output [T, H],
        routed_scaling_factor applied once (in GEMM2's epilogue)."""
        if hidden_states.shape[0] == 0:
            return torch.zeros_like(hidden_states)
        return fused_moe(
            self.prepared,
            hidden_states,
            topk_ids,
            topk_weights,
            self.routing.routed_scaling_factor,
            config,
            fp8_prefill=self.fp8_prefill,
            mxfp8_act=self.numerics == "serving",
        )

    def __call__(self, hidden_states):
        topk_ids, topk_weights = route(hidden_states, self.routing)
        return self.forward_topk(hidden_states, topk_ids, topk_weights)
