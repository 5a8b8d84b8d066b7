"""MiniMax-M3 text model for the porter runtime (facts: docs/minimax-m3.md, the forward pass section).

Plain torch, no nn.Module state dict: every weight is handed in by the loader (runtime/loader.py) in the
dtype it was stored in (memory-mapped on CPU) and cast or MXFP8-dequantized on the fly in forward, so no
second full-precision copy is kept. Shapes: B batch, T new tokens, S keys (cache slots), H hidden,
nq/nkv query/KV heads, d head_dim, ni/di index heads/dim, E experts. Positions and caches: runtime/cache.py.

Layer-at-a-time use (what `porter verify` needs):
    h = model.embed(ids)                          # [B, T, H]
    pos = torch.arange(T)
    for layer in model.layers:                    # lazy=True: each layer is loaded on access, the
        h = layer(h, pos)                         #   previous one freed (see runtime.loader.LazyLayers)
    logits = model.final(h)                       # [B, T, V] fp32
`model(ids, output_hidden_states=True)` returns (logits, [embeddings, output of layer 0, ..., layer L-1]),
the un-normed residual stream (transformers replaces its last entry by the final-normed state).

Decoding (T = 1 over a cache) has static shapes, so the step can be captured in a CUDA graph
(runtime/graph.py). On CUDA it runs fused kernels (DecoderLayer.fused_decode: one projection kernel for
q/k/v/index, norms + RoPE + cache writes in one, residual adds in the GEMV epilogues) and the shared expert
on a second stream, concurrently with the router and the routed experts (MoE.__call__).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from converters.minimax_m3 import TextConfig
from porter.format.layout import scale_name
from runtime.cache import LayerCache, Step
from runtime.kernels import fused, gemv
from runtime.kernels.attention import decode_attention, decode_attention_topk
from runtime.models.causal_lm import CausalLM, DecoderLayerBase
from runtime.models.indexer import Indexer
from runtime.models.layers import (
    Getter,
    Rope,
    add_in_order,
    causal_attention,
    fork,
    join,
    keep_mask,
    linear,
    norm_rope,
    rms_norm,
    stack_linears,
)
from runtime.moe.contract import (
    SIGMOID_BIAS_TOPK,
    MoeQuantInfo,
    MoeRouting,
    make_swiglu_params,
    swiglu_oai,
)


class Attention:
    def __init__(self, cfg: TextConfig, get: Getter, p: str, rope: Rope, sparse: bool):
        self.cfg, self.rope = cfg, rope
        self.q_proj, self.k_proj = linear(get, p + "q_proj"), linear(get, p + "k_proj")
        self.v_proj, self.o_proj = linear(get, p + "v_proj"), linear(get, p + "o_proj")
        self.q_norm, self.k_norm = get(p + "q_norm.weight"), get(p + "k_norm.weight")
        self.indexer = Indexer(cfg, get, p) if sparse else None
        idx = (self.indexer.q_proj, self.indexer.k_proj) if sparse else ()
        # [q; k; v (; index q; index k)] rows: one kernel at decode
        self.qkv = stack_linears(self.q_proj, self.k_proj, self.v_proj, *idx)

    def linears(self) -> list:
        own = [self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.qkv]
        return [lin for lin in own if lin is not None] + (self.indexer.linears() if self.indexer else [])

    def decode(self, x: torch.Tensor, step: Step, cache: LayerCache) -> torch.Tensor:
        """The decode step of __call__ (T = 1 over a cache, CUDA) up to o_proj: x [B, 1, H] -> [B, 1, nq*d].
        Kernels: the stacked projection, norms + RoPE + cache writes, [indexer scores, top-k], attention."""
        cfg, B = self.cfg, x.shape[0]
        nq, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        if step.kv_len > cache.k.shape[2]:
            raise ValueError(
                f"KV cache holds {cache.k.shape[2]} tokens; {step.kv_len} needed (raise max_len)"
            )
        cos, sin = step.rope(self.rope, x.dtype)  # [B, 1, r]
        pos = step.pos[:, 0]  # [B]
        qkv = self.qkv(x.reshape(B, -1))  # [B, nq*d + 2*nkv*d (+ ni*di + di)]
        ix, scores = self.indexer, None
        if ix is None:
            q, _ = fused.decode_qkv(
                qkv, pos, cos, sin, (self.q_norm, self.k_norm), (nq, nkv, d), cache.k, cache.v, eps
            )
        else:
            q, iq = fused.decode_qkv(
                qkv,
                pos,
                cos,
                sin,
                (self.q_norm, self.k_norm, ix.q_norm, ix.k_norm),
                (nq, nkv, d, ix.ni, ix.di),
                cache.k,
                cache.v,
                eps,
                cache.idx_k,
            )
            scores = ix.scores_decode(
                iq, pos, step, cache
            )  # [B, ni, nblk] or None; index head h -> kv head h
        if scores is None:
            out = decode_attention(q, cache.k, cache.v, pos, step.kv_len, None, cfg.index_block_size, d**-0.5)
        else:
            out, top = decode_attention_topk(
                q,
                cache.k,
                cache.v,
                pos,
                step.kv_len,
                scores,
                cfg.index_topk_blocks,
                cfg.index_block_size,
                d**-0.5,
            )  # [B, nq, d]
            ix.kept(top, step)
        return out.reshape(B, 1, nq * d)

    def __call__(self, x: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> torch.Tensor:
        cfg, (B, T, _) = self.cfg, x.shape
        nq, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        cos, sin = step.rope(self.rope, x.dtype)  # [B, T, r]
        q = norm_rope(self.q_proj(x).view(B, T, nq, d), self.q_norm, eps, cos, sin)  # qk-norm, then RoPE
        k = norm_rope(self.k_proj(x).view(B, T, nkv, d), self.k_norm, eps, cos, sin)
        v = self.v_proj(x).view(B, T, nkv, d)
        if cache is None and not step.fresh:  # padded batch without a cache: a scratch one
            cache = LayerCache.empty(cfg, self.indexer is not None, B, step.kv_len, x.dtype, x.device)
        if cache is not None:
            cache.put("k", k, step)
            cache.put("v", v, step)
        top = self.indexer.select(x, cos, sin, step, cache) if self.indexer is not None else None
        if step.decode:
            blocks = None if top is None else top[:, :, 0].expand(B, nkv, -1)  # index head h -> kv head h
            out = decode_attention(
                q[:, 0], cache.k, cache.v, step.pos[:, 0], step.kv_len, blocks, cfg.index_block_size, d**-0.5
            )  # [B, nq, d]
            return self.o_proj(out.reshape(B, 1, nq * d))
        keep = None if top is None else (lambda S: keep_mask(top, S, cfg.index_block_size))  # [B, ni, T, S]
        return self.o_proj(causal_attention(q, k, v, cache, step, keep))


class MLP:
    """SwiGLU-OAI MLP (dense layers and the shared expert), alpha/beta/limit from the resolved config."""

    def __init__(self, cfg: TextConfig, get: Getter, p: str):
        self.gate_proj, self.up_proj = linear(get, p + "gate_proj"), linear(get, p + "up_proj")
        self.down_proj = linear(get, p + "down_proj")
        self.gate_up = stack_linears(self.gate_proj, self.up_proj)  # [gate; up] rows: one GEMV + SwiGLU
        # 0-dim tensors on the weights' device: a Python float would be copied to the GPU on every call,
        # which a CUDA graph cannot capture
        dev = self.down_proj.weight.device
        self.params = (cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)  # floats for the fused kernel
        self.alpha, self.beta, self.limit = (torch.tensor(float(v), device=dev) for v in self.params)

    def linears(self) -> list:
        own = [self.gate_proj, self.up_proj, self.down_proj, self.gate_up]
        return [lin for lin in own if lin is not None]

    def __call__(self, x: torch.Tensor, add: tuple = ()) -> torch.Tensor:
        """x [..., H] -> [..., H]; add: tensors added to the output in order (fused into down's GEMV)."""
        if self.gate_up is not None and gemv.runs(x, self.gate_up.weight):
            x = self.gate_up.input(x)
            act = gemv.gemv(x, self.gate_up.weight, self.gate_up.scale, swiglu=self.params)
        elif self.gate_up is not None and gemv.applies(x, self.gate_up.weight):  # one GEMV, then SwiGLU
            both = self.gate_up(x)  # [..., 2I]
            inter = both.shape[-1] // 2
            act = fused.swiglu(both[..., :inter], both[..., inter:], *self.params)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
            if fused.use_triton(gate):
                act = fused.swiglu(gate, up, *self.params)
            else:
                act = swiglu_oai(gate, up, self.alpha, self.beta, self.limit)
        return self.down_proj(act, add)


class MoE:
    """fp32 sigmoid router + routed experts through a runtime.moe backend (rsf applied there) + shared."""

    def __init__(self, cfg: TextConfig, get: Getter, p: str, device, make_backend: Callable):
        self.cfg = cfg
        self.routing = MoeRouting(
            router_weight=get(p + "gate.weight").float(),  # [E, H] fp32
            e_score_correction_bias=get(p + "e_score_correction_bias").float(),  # [E]
            top_k=cfg.num_experts_per_tok,
            routed_scaling_factor=cfg.routed_scaling_factor,
            method=SIGMOID_BIAS_TOPK,
        )
        w13, w2 = p + "experts.w13_weight", p + "experts.w2_weight"
        quant = MoeQuantInfo(
            w13_weight=get(w13),
            w13_weight_scale=get(scale_name(w13)),  # [E, 2I, H]
            w2_weight=get(w2),
            w2_weight_scale=get(scale_name(w2)),  # [E, H, I]
            **make_swiglu_params(
                cfg.num_local_experts, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit, device
            ),
        )
        self.experts = make_backend(quant, self.routing)
        # The layer holds the canonical tensors only through its backend: one that makes its own layout at
        # load (TRT-LLM's shuffled tensors, the Triton backend's rebase) keeps none, and the experts are
        # resident once.
        self.quant = getattr(self.experts, "quant", None)
        self.shared_experts = MLP(cfg, get, p + "shared_experts.") if cfg.n_shared_experts else None

    def linears(self) -> list:
        return self.shared_experts.linears() if self.shared_experts is not None else []

    def __call__(self, x: torch.Tensor, add: tuple = ()) -> torch.Tensor:
        """x [..., H] -> routed + shared [..., H], then + each of add in order."""
        flat = x.reshape(-1, x.shape[-1])  # [B*T, H]
        add = tuple(a.reshape(flat.shape) for a in add)
        side = self._side_stream(flat)
        if side is None:
            y = self.routed(flat)
            if self.shared_experts is not None:
                return self.shared_experts(flat, (y, *add)).view_as(
                    x
                )  # y + shared expert (unscaled), then add
            for a in add:
                y = y + a
            return y.view_as(x)
        # Decode: the shared expert streams its weights on a second stream while the router and the routed
        # experts run on this one, filling each other's launch gaps and tails (both are bound by weight bytes).
        # Forked and joined inside the call, so every tensor the side stream touches outlives its use.
        with torch.cuda.stream(side):
            s = self.shared_experts(flat)  # [B*T, H]
        y = self.routed(flat)
        join(side)
        return add_in_order(s, (y, *add)).view_as(x)  # (shared + routed) + each add: the unfused order

    def routed(self, flat: torch.Tensor) -> torch.Tensor:
        """flat [N, H] -> routed experts' sum * routed_scaling_factor [N, H]."""
        r = self.routing
        if gemv.applies(flat, r.router_weight):  # fp32 logits kernel + one selection kernel
            logits = fused.router_logits(flat, r.router_weight)  # [N, E]
            ids, weights = fused.router_select(logits, r.e_score_correction_bias, r.top_k)
            return self.experts.forward_topk(flat, ids, weights)
        return self.experts(flat)

    def _side_stream(self, flat: torch.Tensor) -> Optional[torch.cuda.Stream]:
        """The stream the shared expert overlaps on at decode (CUDA, decode-size rows), else None."""
        if not (self.shared_experts is not None and gemv.applies(flat, self.routing.router_weight)):
            return None
        return fork(flat.device)


class DecoderLayer(DecoderLayerBase):
    """Attributes named like the weights (input_layernorm, self_attn.q_proj, ...); `mlp` is the dense MLP
    or, on MoE layers, the block_sparse_moe block."""

    def __init__(self, cfg: TextConfig, get: Getter, i: int, rope: Rope, device, make_backend: Callable):
        p = f"model.layers.{i}."
        self.index, self.eps, self.device = i, cfg.rms_norm_eps, torch.device(device)
        self.input_layernorm = get(p + "input_layernorm.weight")
        self.post_attention_layernorm = get(p + "post_attention_layernorm.weight")
        self.self_attn = Attention(cfg, get, p + "self_attn.", rope, cfg.is_sparse_attention(i))
        if cfg.is_moe(i):
            self.mlp = MoE(cfg, get, p + "block_sparse_moe.", device, make_backend)
        else:
            self.mlp = MLP(cfg, get, p + "mlp.")

    def forward(self, h: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> torch.Tensor:
        """One layer on this layer's device: h [B, T, H] -> [B, T, H]."""
        if self.fused_decode(h, step, cache):
            x = rms_norm(h, self.input_layernorm, self.eps)
            a = self.self_attn.decode(x, step, cache)  # [B, 1, nq*d]
            o_proj = self.self_attn.o_proj
            if gemv.runs(a, o_proj.weight):  # the add in the GEMV's epilogue, then the norm
                h = o_proj(a, add=(h,))  # h + o_proj(a)
                x = rms_norm(h, self.post_attention_layernorm, self.eps)
            else:  # one kernel adds the residual and norms the sum
                h, x = fused.add_rms_norm(o_proj(a), h, self.post_attention_layernorm, self.eps)
            return self.mlp(x, add=(h,))  # h + mlp(x)
        h = h + self.self_attn(rms_norm(h, self.input_layernorm, self.eps), step, cache)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps))

    def fused_decode(self, h: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> bool:
        """Whether this step runs the fused decode kernels (CUDA, decode over a cache, stacked q/k/v)."""
        return (
            step.decode
            and cache is not None
            and self.self_attn.qkv is not None
            and fused.use_triton(h)
            and gemv.applies(h, self.self_attn.qkv.weight)
        )


class MiniMaxM3(CausalLM):
    """`model(ids) -> logits`, `model.generate(ids, max_new_tokens)`; built by runtime.load (runtime.models.
    causal_lm.CausalLM with Gemma norms and the indexer's key caches on sparse layers).

    With a device_map, decoder layer i lives on layer_devices[i] (embeddings on the first device, final
    norm and lm_head on the last) and the residual stream moves between them."""

    norm_offset = 1.0  # Gemma RMSNorm: scales by (1 + w)

    @property
    def cache_block(self) -> int:
        return self.cfg.index_block_size  # whole index blocks: decode attention walks them

    def layer_cache(self, i: int, batch: int, slots: int, device=None) -> LayerCache:
        sparse = self.cfg.is_sparse_attention(i)  # + the indexer's key cache
        return LayerCache.empty(self.cfg, sparse, batch, slots, self.dtype, device or self.layer_devices[i])


Model = MiniMaxM3  # the runtime model registry's names (runtime/models/__init__.py)


def moe_block(cfg: TextConfig, get: Getter, layer: int, device, make_backend: Callable) -> Optional[MoE]:
    """Layer `layer`'s MoE block alone (router, routed experts through make_backend, shared expert)."""
    if not cfg.is_moe(layer):
        return None
    return MoE(cfg, get, f"model.layers.{layer}.block_sparse_moe.", device, make_backend)


def experts_quantized(cfg: TextConfig, names) -> bool:
    """Whether the routed experts are MXFP8 (a stacked expert weight has its scale)."""
    return any(n.endswith("experts.w13_weight_scale") for n in names)
