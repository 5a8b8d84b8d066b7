"""MiniMax-M3 text model for the porter runtime (facts: ../shared/docs/minimax-m3.md §2).

Plain torch, no nn.Module state dict: every weight is handed in by the loader (runtime/loader.py) in the
dtype it was stored in (memory-mapped on CPU) and cast or MXFP8-dequantized on the fly in forward, so no
second full-precision copy is kept. Shapes: B batch, T new tokens, S keys (cache + new), H hidden,
nq/nkv query/KV heads, d head_dim, ni/di index heads/dim, E experts.

Layer-at-a-time use (what `porter verify` needs):
    h = model.embed(ids)                          # [B, T, H]
    pos = torch.arange(T)
    for layer in model.layers:                    # lazy=True: each layer is loaded on access, the
        h = layer(h, pos)                         #   previous one freed (see runtime.loader.LazyLayers)
    logits = model.final(h)                       # [B, T, V] fp32
`model(ids, output_hidden_states=True)` returns (logits, [embeddings, output of layer 0, ..., layer L-1]),
the un-normed residual stream (transformers replaces its last entry by the final-normed state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from converters.minimax_m3 import TextConfig
from porter import mxfp8
from porter.layout import scale_name
from runtime.moe.contract import MoeQuantInfo, MoeRouting, make_swiglu_params, swiglu_oai

Getter = Callable[[str], Optional[torch.Tensor]]  # canonical name -> tensor on the device, or None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm: fp32, scales by (1 + w), cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


class Linear:
    """y = x W^T with W stored as is (bf16/fp32) or MXFP8 (e4m3 + uint8 scales, dequantized per call)."""

    def __init__(self, weight: torch.Tensor, scale: Optional[torch.Tensor] = None):
        self.weight, self.scale = weight, scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            w = mxfp8.dequantize(self.weight, self.scale, x.dtype)
        else:
            w = self.weight.to(x.dtype)
        return F.linear(x, w)


def linear(get: Getter, name: str) -> Linear:
    return Linear(get(name + ".weight"), get(scale_name(name + ".weight")))


# ---------------------------------------------------------------------------------------------------
# RoPE (partial, NeoX halves) and the KV cache


class Rope:
    def __init__(self, rotary_dim: int, theta: float, device):
        # same formula as transformers (compute_default_rope_parameters)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [T, r/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, r]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, n, d]; rotates channels [0, r) (r = cos width), NeoX rotate_half; the rest pass through."""
    r = cos.shape[-1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # [1, T, 1, r]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rot, rest], dim=-1)


@dataclass
class LayerCache:
    """Static per-layer cache; slot s holds the token at absolute position s."""
    k: torch.Tensor  # [B, nkv, S_max, d]
    v: torch.Tensor  # [B, nkv, S_max, d]
    idx_k: Optional[torch.Tensor] = None  # [B, S_max, di] (sparse layers: the indexer's key cache)

    def put(self, name: str, new: torch.Tensor, start: int, dim: int) -> torch.Tensor:
        buf = getattr(self, name)
        end = start + new.shape[dim]
        if end > buf.shape[dim]:
            raise ValueError(f"KV cache holds {buf.shape[dim]} tokens; {end} needed (raise max_len)")
        buf.narrow(dim, start, new.shape[dim]).copy_(new)
        return buf.narrow(dim, 0, end)


class KVCache:
    def __init__(self, layers: list[LayerCache]):
        self.layers, self.length = layers, 0


# ---------------------------------------------------------------------------------------------------
# Attention with the lightning indexer (§2.4, §2.5; transformers 5.23 MiniMaxM3VLIndexer semantics)


class Indexer:
    def __init__(self, cfg: TextConfig, get: Getter, p: str):
        self.wq, self.wk = linear(get, p + "index_q_proj"), linear(get, p + "index_k_proj")
        self.q_norm, self.k_norm = get(p + "index_q_norm.weight"), get(p + "index_k_norm.weight")
        self.cfg, self.ni, self.di = cfg, cfg.index_n_heads, cfg.index_head_dim
        self.last_excluded = 0  # visible (query, index head, block) triples the last call dropped

    def keep_mask(self, x, cos, sin, positions, cache: Optional[LayerCache]) -> Optional[torch.Tensor]:
        """Bool [B, ni, T, S]: keys of the blocks each index head selects; None = every block (dense)."""
        B, T, _ = x.shape
        eps = self.cfg.rms_norm_eps
        cos, sin = cos[:, : self.di], sin[:, : self.di]  # as transformers, should di < rotary_dim
        iq = apply_rope(rms_norm(self.wq(x).view(B, T, self.ni, self.di), self.q_norm, eps), cos, sin)
        ik = apply_rope(rms_norm(self.wk(x).view(B, T, 1, self.di), self.k_norm, eps), cos, sin)[:, :, 0]
        if cache is not None:
            ik = cache.put("idx_k", ik, int(positions[0]), dim=1)  # [B, S, di]
        bs, topk = self.cfg.index_block_size, self.cfg.index_topk_blocks
        S = ik.shape[1]
        nblk = -(-S // bs)
        self.last_excluded = 0
        if nblk <= topk:  # every visible block fits in the budget: exactly dense attention
            return None
        key_pos = torch.arange(S, device=x.device)
        scores = torch.einsum("bthd,bsd->bhts", iq.float(), ik.float())  # [B, ni, T, S]
        scores = scores.masked_fill(key_pos[None, :] > positions[:, None], float("-inf"))  # causal first
        scores = F.pad(scores, (0, nblk * bs - S), value=float("-inf"))
        blocks = scores.view(B, self.ni, T, nblk, bs).amax(-1)  # [B, ni, T, nblk] max-pool
        forced = self._forced_blocks(positions // bs)  # [T, f]
        if forced is not None:
            blocks.scatter_(-1, forced.expand(B, self.ni, -1, -1), float("inf"))  # inside the budget
        top_s, top_i = blocks.topk(topk, dim=-1)  # [B, ni, T, topk]
        top_i = top_i.masked_fill(top_s == float("-inf"), nblk)  # future/empty blocks -> spare column
        sel = torch.zeros(B, self.ni, T, nblk + 1, dtype=torch.bool, device=x.device)
        sel = sel.scatter_(-1, top_i, True)[..., :nblk]  # [B, ni, T, nblk]
        visible = torch.arange(nblk, device=x.device)[None, :] <= (positions // bs)[:, None]  # [T, nblk]
        self.last_excluded = int((visible & ~sel).sum())
        return sel[..., key_pos // bs]  # [B, ni, T, S]

    def _forced_blocks(self, q_block: torch.Tensor) -> Optional[torch.Tensor]:
        """Own block and the local_blocks-1 before it (clamped at 0), plus init blocks already started."""
        local = torch.arange(self.cfg.index_local_blocks, device=q_block.device)
        idx = [(q_block[:, None] - local[None, :]).clamp(min=0)]  # [T, local]
        if self.cfg.index_init_blocks:
            init = torch.arange(self.cfg.index_init_blocks, device=q_block.device)
            idx.append(torch.minimum(init[None, :], q_block[:, None]))  # future init block -> own block
        idx = torch.cat(idx, dim=-1)
        return idx if idx.numel() else None


class Attention:
    def __init__(self, cfg: TextConfig, get: Getter, p: str, rope: Rope, sparse: bool):
        self.cfg, self.rope = cfg, rope
        self.wq, self.wk = linear(get, p + "q_proj"), linear(get, p + "k_proj")
        self.wv, self.wo = linear(get, p + "v_proj"), linear(get, p + "o_proj")
        self.q_norm, self.k_norm = get(p + "q_norm.weight"), get(p + "k_norm.weight")
        self.indexer = Indexer(cfg, get, p) if sparse else None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: Optional[LayerCache]) -> torch.Tensor:
        cfg, (B, T, _) = self.cfg, x.shape
        nq, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        cos, sin = self.rope(positions, x.dtype)  # [T, r]
        q = apply_rope(rms_norm(self.wq(x).view(B, T, nq, d), self.q_norm, eps), cos, sin)  # qk-norm, then RoPE
        k = apply_rope(rms_norm(self.wk(x).view(B, T, nkv, d), self.k_norm, eps), cos, sin)
        v = self.wv(x).view(B, T, nkv, d)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, n, T, d]
        if cache is not None:
            start = int(positions[0])
            k, v = cache.put("k", k, start, dim=2), cache.put("v", v, start, dim=2)  # [B, nkv, S, d]
        elif int(positions[0]) != 0:
            raise ValueError("without a cache, positions must start at 0")
        S = k.shape[2]
        mask = (torch.arange(S, device=x.device)[None, :] <= positions[:, None])[None, None]  # [1, 1, T, S]
        if self.indexer is not None:
            keep = self.indexer.keep_mask(x, cos, sin, positions, cache)  # [B, nkv, T, S] or None
            if keep is not None:
                mask = mask & keep
        out = gqa_attention(q, k, v, mask, d ** -0.5)  # [B, nq, T, d]
        return self.wo(out.transpose(1, 2).reshape(B, T, nq * d))


def gqa_attention(q, k, v, mask, scale) -> torch.Tensor:
    """q [B, nq, T, d], k/v [B, nkv, S, d], mask bool [b, nkv|1, T, S] -> [B, nq, T, d] (no K/V repeat)."""
    B, nq, T, d = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nq // nkv  # query head h uses KV head h // g
    qg = q.reshape(B, nkv, g * T, d)
    m = mask.expand(B, nkv, T, S)[:, :, None].expand(B, nkv, g, T, S).reshape(B, nkv, g * T, S)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)  # [B, nkv, g*T, d]
    return out.reshape(B, nq, T, d)


# ---------------------------------------------------------------------------------------------------
# MLPs (§2.6, §2.7)


class MLP:
    """SwiGLU-OAI MLP (dense layers and the shared expert), alpha/beta/limit from the resolved config."""

    def __init__(self, cfg: TextConfig, get: Getter, p: str):
        self.gate, self.up = linear(get, p + "gate_proj"), linear(get, p + "up_proj")
        self.down = linear(get, p + "down_proj")
        self.alpha, self.beta, self.limit = cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu_oai(self.gate(x), self.up(x), self.alpha, self.beta, self.limit))


class MoE:
    """fp32 sigmoid router + routed experts through a runtime.moe backend (rsf applied there) + shared."""

    def __init__(self, cfg: TextConfig, get: Getter, p: str, device, make_backend: Callable):
        self.cfg = cfg
        self.routing = MoeRouting(router_weight=get(p + "gate.weight").float(),  # [E, H] fp32
                                  e_score_correction_bias=get(p + "e_score_correction_bias").float(),  # [E]
                                  top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor)
        w13, w2 = p + "experts.w13_weight", p + "experts.w2_weight"
        self.quant = MoeQuantInfo(
            w13_weight=get(w13), w13_weight_scale=get(scale_name(w13)),  # [E, 2I, H]
            w2_weight=get(w2), w2_weight_scale=get(scale_name(w2)),  # [E, H, I]
            **make_swiglu_params(cfg.num_local_experts, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit,
                                 device))
        self.experts = make_backend(self.quant, self.routing)
        self.shared = MLP(cfg, get, p + "shared_experts.") if cfg.n_shared_experts else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B*T, H]
        y = self.experts(flat)  # routed sum * routed_scaling_factor
        if self.shared is not None:
            y = y + self.shared(flat)  # shared expert, unscaled
        return y.view_as(x)


class DecoderLayer:
    def __init__(self, cfg: TextConfig, get: Getter, i: int, rope: Rope, device, make_backend: Callable):
        p = f"model.layers.{i}."
        self.index, self.eps = i, cfg.rms_norm_eps
        self.ln_in, self.ln_post = get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight")
        self.attn = Attention(cfg, get, p + "self_attn.", rope, cfg.is_sparse_attention(i))
        if cfg.is_moe(i):
            self.mlp = MoE(cfg, get, p + "block_sparse_moe.", device, make_backend)
        else:
            self.mlp = MLP(cfg, get, p + "mlp.")

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, cache: Optional[LayerCache] = None):
        """h [B, T, H] residual stream, positions [T] absolute (= cache slots) -> [B, T, H]."""
        h = h + self.attn(rms_norm(h, self.ln_in, self.eps), positions, cache)
        return h + self.mlp(rms_norm(h, self.ln_post, self.eps))


# ---------------------------------------------------------------------------------------------------
# Whole model


class MiniMaxM3:
    """`model(ids) -> logits`, `model.generate(ids, max_new_tokens)`; built by runtime.load."""

    def __init__(self, cfg: TextConfig, top: dict, layers, device, dtype):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.embed_tokens, self.norm = top["model.embed_tokens.weight"], top["model.norm.weight"]  # [V, H], [H]
        self.lm_head = top.get("lm_head.weight", self.embed_tokens)  # [V, H] (tied if absent)
        self.layers = layers  # list of DecoderLayer, or runtime.loader.LazyLayers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.to(self.device), self.embed_tokens).to(self.dtype)  # [B, T, H]

    def final(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        return F.linear(h, self.lm_head.to(h.dtype)).float()  # [B, T, V]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c, kw = self.cfg, dict(dtype=self.dtype, device=self.device)
        kv = (batch, c.num_key_value_heads, max_len, c.head_dim)
        return KVCache([LayerCache(torch.zeros(kv, **kw), torch.zeros(kv, **kw),
                                   torch.zeros(batch, max_len, c.index_head_dim, **kw)
                                   if c.is_sparse_attention(i) else None) for i in range(c.num_hidden_layers)])

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: Optional[KVCache] = None, output_hidden_states=False):
        """input_ids [B, T] -> logits [B, T, V] fp32 (and the residual streams if asked)."""
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + input_ids.shape[1], device=self.device)  # [T]
        h = self.embed(input_ids)
        states = [h]
        for i in range(len(self.layers)):
            h = self.layers[i](h, positions, cache.layers[i] if cache is not None else None)
            if output_hidden_states:
                states.append(h)
        if cache is not None:
            cache.length += input_ids.shape[1]
        logits = self.final(h)
        return (logits, states) if output_hidden_states else logits

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
        """Greedy decoding with the KV cache (incl. the indexer key cache) -> [B, T + n]."""
        out = input_ids.to(self.device)
        cache = self.new_cache(out.shape[0], out.shape[1] + max_new_tokens)
        logits = self(out, cache)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            out = torch.cat([out, nxt], dim=1)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
            if out.shape[1] < input_ids.shape[1] + max_new_tokens:
                logits = self(nxt, cache)
        return out
