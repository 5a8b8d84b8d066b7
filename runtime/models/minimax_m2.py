"""MiniMax-M2 text model for the porter runtime (facts: docs/minimax-m2.md, the forward pass section).

Every decoder layer: plain RMSNorm -> attention (q/k RMSNorm over all heads at once, then partial NeoX RoPE,
GQA) -> residual; plain RMSNorm -> MoE (fp32 sigmoid router, e_score_correction_bias for selection only,
top-k renormalised, plain SwiGLU experts through a runtime.moe backend, no routed scaling, no shared
expert) -> residual. Weights come from the loader as stored (MXFP8 dequantized per call); the top-level
model, caches, generate and CUDA-graph decode are runtime.models.causal_lm's. Shapes: B batch, T new tokens,
S keys (cache slots), H hidden, nq/nkv query/KV heads, d head_dim, E experts.

On CUDA a decode step (T = 1 over a cache) runs one GEMV for [q; k; v], the norm kernel on q and k, the
split-K decode attention kernel, the router kernels and the MoE backend's decode path: all static shapes,
so it is captured in a CUDA graph like any runtime model's (runtime/graph.py).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from converters.minimax_m2 import TextConfig
from porter.format.layout import scale_name
from runtime.cache import LayerCache, Step
from runtime.kernels import fused, gemv
from runtime.kernels.attention import decode_attention
from runtime.models.causal_lm import CausalLM, DecoderLayerBase
from runtime.models.layers import (
    Getter,
    Rope,
    apply_rope,
    causal_attention,
    linear,
    rms_norm,
    stack_linears,
)
from runtime.moe.contract import SIGMOID_BIAS_TOPK, MoeQuantInfo, MoeRouting, make_swiglu_params

PLAIN = 0.0  # rms_norm offset of a plain RMSNorm (y * w), as transformers' MiniMaxM2RMSNorm


class Attention:
    def __init__(self, cfg: TextConfig, get: Getter, p: str, rope: Rope):
        self.cfg, self.rope = cfg, rope
        self.q_proj, self.k_proj = linear(get, p + "q_proj"), linear(get, p + "k_proj")
        self.v_proj, self.o_proj = linear(get, p + "v_proj"), linear(get, p + "o_proj")
        self.q_norm, self.k_norm = get(p + "q_norm.weight"), get(p + "k_norm.weight")  # [nq*d], [nkv*d]
        self.qkv = stack_linears(self.q_proj, self.k_proj, self.v_proj)  # [q; k; v] rows: one decode GEMV

    def linears(self) -> list:
        own = [self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.qkv]
        return [lin for lin in own if lin is not None]

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, T, nq*d], k, v [B, T, nkv*d] (one stacked GEMV at decode on CUDA)."""
        if self.qkv is not None and gemv.applies(x, self.qkv.weight):
            nq, nkv = self.q_norm.shape[0], self.k_norm.shape[0]
            return self.qkv(x).split([nq, nkv, nkv], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def __call__(self, x: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> torch.Tensor:
        cfg, (B, T, _) = self.cfg, x.shape
        nq, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        cos, sin = step.rope(self.rope, x.dtype)  # [B, T, r]
        q, k, v = self._qkv(x)
        q = rms_norm(q, self.q_norm, eps, PLAIN).view(B, T, nq, d)  # norm over all heads, then RoPE
        k = rms_norm(k, self.k_norm, eps, PLAIN).view(B, T, nkv, d)
        q, k, v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(B, T, nkv, d)
        if cache is None and not step.fresh:  # padded batch without a cache: a scratch one
            cache = LayerCache.empty(cfg, False, B, step.kv_len, x.dtype, x.device)
        if cache is not None:
            cache.put("k", k, step)
            cache.put("v", v, step)
        if step.decode:
            out = decode_attention(q[:, 0], cache.k, cache.v, step.pos[:, 0], step.kv_len, None, 1, d**-0.5)
            return out.reshape(B, 1, nq * d)  # [B, nq, d] -> [B, 1, nq*d]
        return causal_attention(q, k, v, cache, step)


class MoE:
    """fp32 sigmoid router (+ e_score_correction_bias for selection) + plain-SwiGLU routed experts through a
    runtime.moe backend. No shared expert, no routed scaling."""

    def __init__(self, cfg: TextConfig, get: Getter, p: str, device, make_backend: Callable):
        bias = get(p + "e_score_correction_bias").float() if cfg.use_routing_bias else None  # [E]
        self.routing = MoeRouting(
            router_weight=get(p + "gate.weight").float().contiguous(),  # [E, H] fp32 (vLLM's fp32 router)
            e_score_correction_bias=bias,
            top_k=cfg.num_experts_per_tok,
            routed_scaling_factor=cfg.routed_scaling_factor,
            method=SIGMOID_BIAS_TOPK,
        )
        # the router kernel takes a bias: zeros select as none
        self.select_bias = bias if bias is not None else torch.zeros(cfg.num_local_experts, device=device)
        w13, w2 = p + "experts.w13_weight", p + "experts.w2_weight"
        quant = MoeQuantInfo(
            w13_weight=get(w13),  # [E, 2I, H]
            w13_weight_scale=get(scale_name(w13)),
            w2_weight=get(w2),  # [E, H, I]
            w2_weight_scale=get(scale_name(w2)),
            **make_swiglu_params(
                cfg.num_local_experts, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit, device
            ),  # plain SwiGLU: alpha 1, beta 0, no clamp
        )
        self.experts = make_backend(quant, self.routing)
        self.quant = getattr(self.experts, "quant", None)  # the canonical tensors live only in the backend

    def linears(self) -> list:
        return []

    def __call__(self, x: torch.Tensor, add: tuple = ()) -> torch.Tensor:
        """x [..., H] -> routed experts [..., H], then + each of add in order."""
        flat = x.reshape(-1, x.shape[-1])  # [B*T, H]
        y = self.routed(flat)
        for a in add:
            y = y + a.reshape(flat.shape)
        return y.view_as(x)

    def routed(self, flat: torch.Tensor) -> torch.Tensor:
        r = self.routing
        if gemv.applies(flat, r.router_weight):  # fp32 logits kernel + one selection kernel
            logits = fused.router_logits(flat, r.router_weight)  # [N, E]
            ids, weights = fused.router_select(logits, self.select_bias, r.top_k)
            return self.experts.forward_topk(flat, ids, weights)
        return self.experts(flat)


class DecoderLayer(DecoderLayerBase):
    """Attributes named like the weights (input_layernorm, self_attn.q_proj, ...); `mlp` is the
    block_sparse_moe block."""

    def __init__(self, cfg: TextConfig, get: Getter, i: int, rope: Rope, device, make_backend: Callable):
        p = f"model.layers.{i}."
        self.index, self.eps, self.device = i, cfg.rms_norm_eps, torch.device(device)
        self.input_layernorm = get(p + "input_layernorm.weight")
        self.post_attention_layernorm = get(p + "post_attention_layernorm.weight")
        self.self_attn = Attention(cfg, get, p + "self_attn.", rope)
        self.mlp = MoE(cfg, get, p + "block_sparse_moe.", device, make_backend)

    def forward(self, h: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> torch.Tensor:
        """One layer on this layer's device: h [B, T, H] -> [B, T, H]."""
        a = self.self_attn(rms_norm(h, self.input_layernorm, self.eps, PLAIN), step, cache)
        h = self.self_attn.o_proj(a, add=(h,))  # h + o_proj(a) (the add in the GEMV's epilogue on CUDA)
        return self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps, PLAIN), add=(h,))


class MiniMaxM2(CausalLM):
    """`model(ids) -> logits`, `model.generate(...)`: runtime.models.causal_lm.CausalLM with plain RMSNorms
    and dense attention caches. With a device_map, decoder layer i lives on layer_devices[i]."""

    norm_offset = PLAIN


Model = MiniMaxM2  # the runtime model registry's names (runtime/models/__init__.py)


def moe_block(cfg: TextConfig, get: Getter, layer: int, device, make_backend: Callable) -> Optional[MoE]:
    """Layer `layer`'s MoE block alone (router and routed experts through make_backend)."""
    return MoE(cfg, get, f"model.layers.{layer}.block_sparse_moe.", device, make_backend)


def experts_quantized(cfg: TextConfig, names) -> bool:
    """Whether the routed experts are MXFP8 (a stacked expert weight has its scale)."""
    return any(n.endswith("experts.w13_weight_scale") for n in names)
