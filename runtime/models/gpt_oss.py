"""gpt-oss (20b, 120b) for the porter runtime (facts: docs/gpt-oss.md, the forward pass section).

Per layer: RMSNorm (weight * normed), attention with biases, YaRN RoPE, grouped KV heads and a learned sink
logit per head (a column the softmax sees and the output drops), over a sliding window of
`sliding_window` keys on sliding layers and every earlier key on full ones; RMSNorm; routed experts with
biases (router: linear with bias, top-k of the logits, softmax over the k chosen) through a runtime.moe
backend. Weights come from the loader's getter in their stored dtype (runtime/models/layers.py's Linear
casts or MXFP8-dequantizes per call). Shapes: B batch, T new tokens, S keys (cache slots), H hidden, nq/nkv
query/KV heads, d head_dim, W window, E experts.

Attention is torch ops (no host sync), so a decode step (T = 1 over a cache, static shapes) is captured in a
CUDA graph (runtime/graph.py): full layers attend over every cache slot with a mask from the positions,
sliding layers gather their W slots before each row's position.

    model = runtime.load("out/gpt-oss-mxfp8")    # picked by porter.json's architecture
    h = model.embed(ids); pos = torch.arange(T)
    for layer in model.layers: h = layer(h, pos)
    logits = model.final(h)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from converters.gpt_oss import GptOssConfig
from porter.format.layout import scale_name
from runtime.cache import LayerCache, Step
from runtime.models import layers
from runtime.models.causal_lm import CausalLM, DecoderLayerBase
from runtime.models.layers import Getter, Rope, apply_rope, linear, yarn_inv_freq
from runtime.moe.contract import TOPK_SOFTMAX, MoeQuantInfo, MoeRouting, make_swiglu_params

LOGIT_BYTES = 256 << 20  # fp32 attention logits computed at once in a prefill (queries are chunked to fit)


def rope(cfg: GptOssConfig, device) -> Rope:
    """The model's RoPE: YaRN (inverse frequencies and cos/sin scaling from the config) or plain."""
    if cfg.rope_type == "default":
        return Rope(cfg.rotary_dim, cfg.rope_theta, device)
    inv = yarn_inv_freq(
        cfg.rotary_dim,
        cfg.rope_theta,
        cfg.rope_factor,
        cfg.rope_beta_fast,
        cfg.rope_beta_slow,
        cfg.rope_original_max_position_embeddings,
        cfg.rope_truncate,
    )
    return Rope(
        cfg.rotary_dim, cfg.rope_theta, device, inv_freq=inv, attention_scaling=cfg.rope_attention_factor
    )


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """gpt-oss RMSNorm: normed in fp32, times the weight (offset 0: not 1 + weight), cast back to x's dtype
    (runtime.models.layers.rms_norm: one kernel on CUDA)."""
    return layers.rms_norm(x, w, eps, offset=0.0)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    sinks: torch.Tensor,
    window: Optional[int],
    scale: float,
    slots: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """q [B, nq, T, d] at positions pos [B, T]; k/v [B, nkv, S, d] holding positions `slots` ([B, S], default
    0..S-1) -> [B, nq, T, d]. A key is visible when its position is <= the query's and, with a window,
    > the query's - window; each head's sink logit joins its softmax and is dropped after. fp32 softmax."""
    B, nq, T, d = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nq // nkv  # query head h uses KV head h // g
    if slots is None:
        slots = torch.arange(S, device=q.device).expand(B, S)
    sink = sinks.float().view(1, nkv, g, 1, 1)
    out = torch.empty_like(q)
    step = max(1, LOGIT_BYTES // max(1, B * nq * S * 4))
    for t0 in range(0, T, step):  # query chunks bound the [.., T, S] logits
        qc, pc = q[:, :, t0 : t0 + step], pos[:, t0 : t0 + step]  # [B, nq, t, d], [B, t]
        t = qc.shape[2]
        logits = torch.matmul(qc.reshape(B, nkv, g * t, d).float(), k.float().transpose(-1, -2)) * scale
        logits = logits.view(B, nkv, g, t, S)
        rel = pc[:, :, None] - slots[:, None, :]  # [B, t, S] query position - key position
        seen = rel >= 0
        if window is not None:
            seen &= rel < window
        logits = logits.masked_fill(~seen[:, None, None], float("-inf"))
        top = torch.maximum(logits.amax(-1, keepdim=True), sink)  # [B, nkv, g, t, 1]
        p = torch.exp(logits - top)
        probs = p / (p.sum(-1, keepdim=True) + torch.exp(sink - top))  # the sink's share is dropped
        o = torch.matmul(probs.view(B, nkv, g * t, S).to(v.dtype), v)  # [B, nkv, g*t, d]
        out[:, :, t0 : t0 + t] = o.view(B, nq, t, d)
    return out


class Attention:
    def __init__(self, cfg: GptOssConfig, get: Getter, p: str, rope: Rope, sliding: bool):
        self.cfg, self.rope = cfg, rope
        bias = cfg.attention_bias
        self.q_proj, self.k_proj = linear(get, p + "q_proj", bias), linear(get, p + "k_proj", bias)
        self.v_proj, self.o_proj = linear(get, p + "v_proj", bias), linear(get, p + "o_proj", bias)
        self.sinks = get(p + "sinks")  # [nq] learned sink logits
        self.window = cfg.sliding_window if sliding else None

    def linears(self) -> list:
        return [self.q_proj, self.k_proj, self.v_proj, self.o_proj]

    def __call__(self, x: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> torch.Tensor:
        cfg, (B, T, _) = self.cfg, x.shape
        nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = step.rope(self.rope, x.dtype)  # [B, T, d]
        q = apply_rope(self.q_proj(x).view(B, T, nq, d), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, nkv, d), cos, sin)
        v = self.v_proj(x).view(B, T, nkv, d)
        if cache is None and not step.fresh:  # padded batch without a cache: a scratch one
            cache = LayerCache.empty(cfg, False, B, step.kv_len, x.dtype, x.device)
        if cache is not None:
            cache.put("k", k, step)
            cache.put("v", v, step)
        q = q.transpose(1, 2)  # [B, nq, T, d]
        if cache is None:  # fresh, no cache: the new keys are slots 0..T-1
            keys, vals, slots = k.transpose(1, 2), v.transpose(1, 2), None
        elif step.decode and self.window is not None and step.kv_len > self.window:
            keys, vals, slots = self._window_slots(cache, step)  # [B, nkv, W, d]: this row's last W
        else:
            S = step.kv_len
            keys, vals, slots = cache.k[:, :, :S], cache.v[:, :, :S], None
        out = sink_attention(q, keys, vals, step.pos, self.sinks, self.window, d**-0.5, slots)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, nq * d))

    def _window_slots(self, cache: LayerCache, step: Step):
        """Decode on a sliding layer: each row's W slots up to its position, gathered (static shapes)."""
        W, pos = self.window, step.pos[:, 0]  # [B]
        slots = pos[:, None] - W + 1 + torch.arange(W, device=pos.device)  # [B, W]; < 0 before the start
        idx = slots.clamp_min(0)[:, None, :, None].expand(-1, cache.k.shape[1], -1, cache.k.shape[3])
        # a slot before the start is read as slot 0 but masked: its "position" stays negative, so
        # query - key >= W
        return cache.k.gather(2, idx), cache.v.gather(2, idx), torch.where(slots < 0, pos[:, None] - W, slots)


class MoE:
    """Router (linear with bias, top-k of the logits, softmax over the k) + experts with biases."""

    def __init__(self, cfg: GptOssConfig, get: Getter, p: str, device, make_backend: Callable):
        self.routing = MoeRouting(  # logits = x W^T + b; top-k of the logits, softmax over the k
            router_weight=get(p + "router.weight").float(),  # [E, H]
            router_bias=get(p + "router.bias").float(),  # [E]
            e_score_correction_bias=None,
            top_k=cfg.num_experts_per_tok,
            routed_scaling_factor=1.0,
            method=TOPK_SOFTMAX,
        )
        x = p + "experts."
        quant = MoeQuantInfo(
            w13_weight=get(x + "w13_weight"),  # [E, 2I, H] [gate; up]
            w13_weight_scale=get(scale_name(x + "w13_weight")),
            w2_weight=get(x + "w2_weight"),  # [E, H, I]
            w2_weight_scale=get(scale_name(x + "w2_weight")),
            w13_bias=get(x + "w13_bias").float(),  # [E, 2I] [gate; up]
            w2_bias=get(x + "w2_bias").float(),  # [E, H]
            **make_swiglu_params(
                cfg.num_local_experts, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit, device
            ),
        )
        self.experts = make_backend(quant, self.routing)
        self.quant = getattr(self.experts, "quant", None)  # held only through the backend (its own layout)

    def linears(self) -> list:
        return []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> the routed experts' weighted sum [..., H] (routing in the backend, by the contract)."""
        return self.experts(x.reshape(-1, x.shape[-1])).view_as(x)


class DecoderLayer(DecoderLayerBase):
    """Attributes named like the weights (input_layernorm, self_attn.q_proj, mlp = the MoE block)."""

    def __init__(self, cfg: GptOssConfig, get: Getter, i: int, rope: Rope, device, make_backend: Callable):
        p = f"model.layers.{i}."
        self.index, self.eps, self.device = i, cfg.rms_norm_eps, torch.device(device)
        self.input_layernorm = get(p + "input_layernorm.weight")
        self.post_attention_layernorm = get(p + "post_attention_layernorm.weight")
        self.self_attn = Attention(cfg, get, p + "self_attn.", rope, cfg.is_sliding(i))
        self.mlp = MoE(cfg, get, p + "mlp.", device, make_backend)

    def forward(self, h: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> torch.Tensor:
        """One layer on this layer's device: h [B, T, H] -> [B, T, H]."""
        h = h + self.self_attn(rms_norm(h, self.input_layernorm, self.eps), step, cache)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))


class GptOss(CausalLM):
    """`model(ids) -> logits`, `model.generate(prompt, max_new_tokens)`; built by runtime.load. Embeddings,
    final norm, caches, positions, generate and CUDA-graph decode are the shared CausalLM's; gpt-oss brings
    its decoder layers (sinks, sliding window, biased experts) and a plain RMSNorm. generate's chat=True
    renders the checkpoint's harmony template."""

    norm_offset = 0.0  # plain RMSNorm (y * w), as rms_norm above


Model = GptOss  # the runtime model registry's names (runtime/models/__init__.py)


def moe_block(cfg: GptOssConfig, get: Getter, layer: int, device, make_backend: Callable) -> MoE:
    """Layer `layer`'s MoE block alone (router and experts with biases through make_backend)."""
    return MoE(cfg, get, f"model.layers.{layer}.mlp.", device, make_backend)


def experts_quantized(cfg: GptOssConfig, names) -> bool:
    """Whether the routed experts are MXFP8 (a stacked expert weight has its scale)."""
    return any(n.endswith("experts.w13_weight_scale") for n in names)
