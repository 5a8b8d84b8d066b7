"""MiniMax-M3 text model for the porter runtime (facts: docs/minimax-m3.md, the forward pass section).

Plain torch, no nn.Module state dict: every weight is handed in by the loader (runtime/loader.py) in the
dtype it was stored in (memory-mapped on CPU) and cast or MXFP8-dequantized on the fly in forward, so no
second full-precision copy is kept. Shapes: B batch, T new tokens, S keys (cache slots), H hidden,
nq/nkv query/KV heads, d head_dim, ni/di index heads/dim, E experts.

Positions are per row ([B, T]) and the KV cache is position-indexed (slot s of row b = that row's token
at position s), so left-padded batches of different prompt lengths run together: pad tokens
(`attention_mask` 0) are never written to the cache, attend to slot 0 only, and their outputs are junk
that nobody reads. A row then computes exactly what it computes alone.

Layer-at-a-time use (what `porter verify` needs):
    h = model.embed(ids)                          # [B, T, H]
    pos = torch.arange(T)
    for layer in model.layers:                    # lazy=True: each layer is loaded on access, the
        h = layer(h, pos)                         #   previous one freed (see runtime.loader.LazyLayers)
    logits = model.final(h)                       # [B, T, V] fp32
`model(ids, output_hidden_states=True)` returns (logits, [embeddings, output of layer 0, ..., layer L-1]),
the un-normed residual stream (transformers replaces its last entry by the final-normed state).

Decoding (T = 1 over a cache) has static shapes: attention reads the cache through
runtime.attention.decode_attention (dense layers: slots <= position, no mask tensor; sparse layers: only
the blocks the indexer picked), so the step can be captured in a CUDA graph (`generate(...,
cuda_graph=True)`, class DecodeGraph).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from converters.minimax_m3 import TextConfig
from porter import mxfp8
from porter.layout import scale_name
from runtime import fused, gemv
from runtime.attention import decode_attention, decode_attention_topk
from runtime.moe.contract import MoeQuantInfo, MoeRouting, make_swiglu_params, swiglu_oai

Getter = Callable[[str], Optional[torch.Tensor]]  # canonical name -> tensor on the device, or None

# The fused decode step (DecoderLayer.decode: one projection kernel for q/k/v/index, norms + RoPE + cache
# writes in one kernel, the indexer and the router in two each, residual adds in the GEMV epilogues).
# PORTER_FUSED_DECODE=0 runs the attention, indexer and residual adds op by op instead (A/B benchmarks,
# tests); the router kernels and the shared expert's stacked gate/up GEMV + SwiGLU run in both.
FUSED_DECODE = os.environ.get("PORTER_FUSED_DECODE", "1") != "0"
# At decode the MoE block runs its shared expert on a second CUDA stream, concurrently with the router and
# the routed experts (MoE.__call__); PORTER_MOE_OVERLAP=0 runs them one after the other (A/B, tests).
MOE_OVERLAP = os.environ.get("PORTER_MOE_OVERLAP", "1") != "0"
_SIDE_STREAMS: dict = {}  # device index -> the shared expert's stream (one decoding thread per device)


def _fork(device: torch.device) -> torch.cuda.Stream:
    """The device's second stream, ordered after everything launched so far on the current one."""
    if device.index not in _SIDE_STREAMS:
        _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    side = _SIDE_STREAMS[device.index]
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _join(side: torch.cuda.Stream) -> None:
    """Order what comes next on the current stream after everything launched on side."""
    torch.cuda.current_stream(side.device).wait_stream(side)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm: fp32, scales by (1 + w), cast back to x's dtype (one kernel on CUDA)."""
    if fused.use_triton(x):
        return fused.rms_norm(x, w, eps)
    return rms_norm_reference(x, w, eps)


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm in torch ops on any device (what the kernel is checked against)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def on_device(device: torch.device):
    """Make `device` current while a layer runs: Triton launches on the current device's stream, so a
    layer on cuda:1 launched with cuda:0 current would race its own inputs (device_map)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()  # already current (one GPU: exactly the path measured), or CPU


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Linear:
    """y = x W^T with W stored as is (bf16/fp32) or MXFP8 (e4m3 + uint8 scales). On CUDA with few rows
    (decode) MXFP8 runs one GEMV kernel (runtime.gemv) that streams the 1-byte weights once, dequantized
    in registers (16-bit weights too where gemv.runs says it pays); elsewhere the weight is cast or
    dequantized per call, then multiplied; a 16-bit weight against one row runs runtime.gemv.gemv_stream
    (faster than cuBLAS there). add: tensors [..., N] added to the output in order, in its
    dtype (residual adds; fused into the GEMV's epilogue when it runs)."""

    def __init__(self, weight: torch.Tensor, scale: Optional[torch.Tensor] = None):
        self.weight, self.scale = weight, scale

    def __call__(self, x: torch.Tensor, add: tuple = ()) -> torch.Tensor:
        if len(add) <= 2 and gemv.runs(x, self.weight):  # the epilogue takes two adds
            return gemv.gemv(x, self.weight, self.scale, add=add)
        if gemv.streams(x, self.weight):
            y = gemv.gemv_stream(x, self.weight)
        else:
            if self.scale is not None:
                w = mxfp8.dequantize(self.weight, self.scale, x.dtype)
            else:
                w = self.weight.to(x.dtype)
            y = F.linear(x, w)
        return add_in_order(y, add)


def add_in_order(y: torch.Tensor, add: tuple) -> torch.Tensor:
    """((y + add[0]) + add[1]) ..., rounded after each add; on CUDA up to two same-shape, same-dtype adds in one
    kernel (fused.add_chain, the same rounding)."""
    if add and len(add) <= 2 and fused.use_triton(y) and all(a.shape == y.shape and a.dtype == y.dtype
                                                             for a in add):
        return fused.add_chain(y, *add)
    for a in add:
        y = y + a
    return y


def linear(get: Getter, name: str) -> Linear:
    return Linear(get(name + ".weight"), get(scale_name(name + ".weight")))


def stack_linears(*parts: Linear) -> Optional[Linear]:
    """One Linear whose weight rows are the parts' rows stacked (linears of the same input: at decode one
    kernel streams them all). Each part keeps a view of its rows, so no weight is stored twice. None when
    they cannot share a kernel (weights not on CUDA, mixed dtypes, devices or quantization)."""
    ws = [p.weight for p in parts]
    if not all(fused.use_triton(w) for w in ws) or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 \
            or len({p.scale is None for p in parts}) != 1:
        return None
    w = torch.cat(ws)  # [sum N, K]
    s = None if parts[0].scale is None else torch.cat([p.scale for p in parts])  # [sum N, K/32]
    row = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight, p.scale = w[row: row + n], None if s is None else s[row: row + n]
        row += n
    return Linear(w, s)


# ---------------------------------------------------------------------------------------------------
# RoPE (partial, NeoX halves), positions and the KV cache


class Rope:
    def __init__(self, rotary_dim: int, theta: float, device):
        # same formula as transformers (compute_default_rope_parameters)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.inv_freq = self.inv_freq.to(device)

    def __call__(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq if self.inv_freq.device == positions.device else self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv  # [B, T, r/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, r]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, n, d], cos/sin [B, T, r]; rotates channels [0, r), NeoX rotate_half; the rest pass through."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, r]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rot, rest], dim=-1)


def norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-head qk-norm, then RoPE: x [B, T, n, d] -> [B, T, n, d] (one kernel on CUDA)."""
    if fused.use_triton(x):
        return fused.norm_rope(x, w, eps, cos, sin)
    return apply_rope(rms_norm(x, w, eps), cos, sin)


@dataclass
class Step:
    """Where the T new tokens of one forward pass sit.

    pos [B, T] absolute positions = cache slots (pad tokens: 0); valid [B, T] bool or None (all real);
    kv_len: the slots attended are [0, kv_len) (host int, static under CUDA-graph capture);
    fresh: every row's positions are 0..T-1 with no earlier keys (plain causal prefill);
    decode: T == 1 over a cache (static-shape decode attention)."""
    pos: torch.Tensor
    valid: Optional[torch.Tensor]
    kv_len: int
    fresh: bool = False
    decode: bool = False
    _copies: dict = field(default_factory=dict, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)

    def memo(self, key, make: Callable[[], object]):
        """What depends only on the positions (cos/sin, causal masks, forced blocks): made once per
        forward and shared by the layers (a captured decode step clears it, so the graph makes it)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def rope(self, rope: "Rope", dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, T, r] of these positions."""
        return self.memo(("rope", id(rope), dtype), lambda: rope(self.pos, dtype))

    def on(self, device: torch.device) -> "Step":
        """This step with pos/valid on `device` (one copy per device: layers spread by a device_map)."""
        device = torch.device(device)
        if self.pos.device == device:
            return self
        if device not in self._copies:
            self._copies[device] = Step(self.pos.to(device), None if self.valid is None else self.valid.to(device),
                                        self.kv_len, self.fresh, self.decode)
        return self._copies[device]

    @classmethod
    def of(cls, positions: torch.Tensor, batch: int, cache: Optional["LayerCache"] = None,
           valid: Optional[torch.Tensor] = None) -> "Step":
        """From explicit positions ([T] shared by the rows, or [B, T]); the layer-at-a-time API."""
        pos = positions.expand(batch, positions.shape[-1]) if positions.dim() == 1 else positions
        T = pos.shape[1]
        if cache is None:
            if valid is None and positions.dim() == 1:
                if int(positions[0]) != 0:
                    raise ValueError("without a cache, positions must start at 0")
                return cls(pos, None, T, fresh=True)
            return cls(pos, valid, int(pos.max()) + 1)
        return cls(pos, valid, int(pos.max()) + 1, decode=T == 1 and valid is None)


@dataclass
class LayerCache:
    """Static per-layer cache, position-indexed: slot s of row b holds row b's token at position s."""
    k: torch.Tensor  # [B, nkv, S_max, d]
    v: torch.Tensor  # [B, nkv, S_max, d]
    idx_k: Optional[torch.Tensor] = None  # [B, S_max, di] (sparse layers: the indexer's key cache)

    @classmethod
    def empty(cls, cfg: TextConfig, sparse: bool, batch: int, slots: int, dtype, device) -> "LayerCache":
        """Zeroed k/v [B, nkv, slots, d]; sparse (an indexer layer): also the index keys [B, slots, di]."""
        kv = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
        idx = torch.zeros(batch, slots, cfg.index_head_dim, dtype=dtype, device=device) if sparse else None
        return cls(torch.zeros(kv, dtype=dtype, device=device), torch.zeros(kv, dtype=dtype, device=device), idx)

    def put(self, name: str, new: torch.Tensor, step: Step) -> None:
        """new [B, T, ...] (k/v: [B, T, nkv, d]; idx_k: [B, T, di]) -> slots step.pos of its rows."""
        buf = getattr(self, name)
        slots = buf.shape[1] if name == "idx_k" else buf.shape[2]
        if step.kv_len > slots:
            raise ValueError(f"KV cache holds {slots} tokens; {step.kv_len} needed (raise max_len)")
        B, T = new.shape[:2]
        rows = step.memo(("rows", B, T), lambda: torch.arange(B, device=new.device)[:, None].expand(B, T))
        pos = step.pos
        if step.valid is not None:  # pad tokens are never written
            rows, pos, new = rows[step.valid], pos[step.valid], new[step.valid]
        if name == "idx_k":
            buf[rows, pos] = new.to(buf.dtype)
        else:
            buf[rows, :, pos] = new.to(buf.dtype)  # advanced dims first: [B, T, nkv, d]


class KVCache:
    """Per-layer caches plus where each row continues: `length` (host) = token columns consumed so far,
    `next_pos` [B] (device) = the next position of each row (< length when the row had pad tokens)."""

    def __init__(self, layers: list[LayerCache], next_pos: torch.Tensor):
        self.layers, self.length, self.next_pos = layers, 0, next_pos

    @property
    def max_len(self) -> int:
        return self.layers[0].k.shape[2]


# ---------------------------------------------------------------------------------------------------
# Attention with the lightning indexer (transformers 5.23 MiniMaxM3VLIndexer semantics)


class Indexer:
    def __init__(self, cfg: TextConfig, get: Getter, p: str):
        self.wq, self.wk = linear(get, p + "index_q_proj"), linear(get, p + "index_k_proj")
        self.q_norm, self.k_norm = get(p + "index_q_norm.weight"), get(p + "index_k_norm.weight")
        self.cfg, self.ni, self.di = cfg, cfg.index_n_heads, cfg.index_head_dim
        self._dropped: Optional[torch.Tensor] = None  # 0-dim count behind last_excluded, left on the device

    @property
    def last_excluded(self) -> int:
        """Visible (query, index head, block) triples the last call dropped (diagnostics: read on demand, so
        a decode step does not wait for the device once per sparse layer)."""
        return 0 if self._dropped is None else int(self._dropped)

    def select(self, x, cos, sin, step: Step, cache: Optional[LayerCache]) -> Optional[torch.Tensor]:
        """-> top blocks [B, ni, T, topk] of each query (entry nblk = none left), or None = every visible
        block (dense). Only the new queries are scored, against the cached index keys."""
        B, T, _ = x.shape
        eps = self.cfg.rms_norm_eps
        cos, sin = cos[..., : self.di], sin[..., : self.di]  # as transformers, should di < rotary_dim
        iq = norm_rope(self.wq(x).view(B, T, self.ni, self.di), self.q_norm, eps, cos, sin)  # [B, T, ni, di]
        ik = norm_rope(self.wk(x).view(B, T, 1, self.di), self.k_norm, eps, cos, sin)[:, :, 0]  # [B, T, di]
        S = step.kv_len
        if cache is not None:
            cache.put("idx_k", ik, step)
            ik = cache.idx_k[:, :S]  # [B, S, di]
        bs, topk = self.cfg.index_block_size, self.cfg.index_topk_blocks
        nblk = -(-S // bs)
        if not _capturing():
            self._dropped = None
        if nblk <= topk:  # every visible block fits in the budget: exactly dense attention
            return None
        pos = step.pos  # [B, T]
        future = step.memo(("future", S), lambda: torch.arange(S, device=x.device) > pos[:, None, :, None])
        scores = torch.einsum("bthd,bsd->bhts", iq.float(), ik.float())  # [B, ni, T, S]
        scores = scores.masked_fill(future, float("-inf"))  # causal first
        scores = F.pad(scores, (0, nblk * bs - S), value=float("-inf"))
        blocks = scores.view(B, self.ni, T, nblk, bs).amax(-1)  # [B, ni, T, nblk] max-pool
        forced = step.memo(("forced", bs), lambda: self._forced_blocks(pos // bs))  # [B, T, f]
        if forced is not None:
            blocks.scatter_(-1, forced[:, None].expand(B, self.ni, -1, -1), float("inf"))  # inside the budget
        top_s, top_i = blocks.topk(topk, dim=-1)  # [B, ni, T, topk]
        top_i = top_i.masked_fill(top_s == float("-inf"), nblk)  # future/empty blocks -> "none"
        if not _capturing():
            self._dropped = self._excluded(top_i, nblk, pos // bs + 1, step.valid)
        return top_i

    def scores_decode(self, iq: torch.Tensor, pos: torch.Tensor, step: Step, cache: LayerCache):
        """select() at decode up to the block scores, after fused.decode_qkv wrote the new index key:
        iq [B, ni, di] (normed, RoPE'd) -> [B, ni, nblk] fp32, or None (every visible block fits the
        budget). The attention picks the top-k (runtime.attention.decode_attention_topk), then kept()."""
        nblk = -(-step.kv_len // self.cfg.index_block_size)
        if not _capturing():
            self._dropped = None
        if nblk <= self.cfg.index_topk_blocks:
            return None
        return fused.index_scores(iq, cache.idx_k, pos, step.kv_len, self.cfg.index_block_size,
                                  self.cfg.index_local_blocks, self.cfg.index_init_blocks)

    def kept(self, top: torch.Tensor, step: Step) -> None:
        """The blocks the decode attention kept, top [B, ni, topk] (diagnostics: last_excluded)."""
        if not _capturing():
            bs = self.cfg.index_block_size
            self._dropped = self._excluded(top[:, :, None], -(-step.kv_len // bs), step.pos // bs + 1, None)

    def _excluded(self, top_i, nblk, visible, valid) -> torch.Tensor:
        """Visible blocks not selected, over index heads and real queries (0-dim, on the device)."""
        chosen = (top_i < nblk).sum(-1)  # [B, ni, T] (selected blocks are always visible)
        dropped = visible[:, None, :] - chosen
        if valid is not None:
            dropped = dropped * valid[:, None, :]
        return dropped.sum()

    def _forced_blocks(self, q_block: torch.Tensor) -> Optional[torch.Tensor]:
        """[B, T] -> [B, T, f]: own block and the local_blocks-1 before it (clamped at 0), plus init
        blocks already started."""
        local = torch.arange(self.cfg.index_local_blocks, device=q_block.device)
        idx = [(q_block[..., None] - local).clamp(min=0)]  # [B, T, local]
        if self.cfg.index_init_blocks:
            init = torch.arange(self.cfg.index_init_blocks, device=q_block.device)
            idx.append(torch.minimum(init, q_block[..., None]))  # future init block -> own block
        idx = torch.cat(idx, dim=-1)
        return idx if idx.numel() else None


def keep_mask(top_i: torch.Tensor, S: int, block: int) -> torch.Tensor:
    """top blocks [B, ni, T, topk] (nblk = none) -> bool [B, ni, T, S] keys of the selected blocks."""
    nblk = -(-S // block)
    sel = torch.zeros(*top_i.shape[:-1], nblk + 1, dtype=torch.bool, device=top_i.device)
    sel = sel.scatter_(-1, top_i, True)[..., :nblk]  # [B, ni, T, nblk]
    return sel[..., torch.arange(S, device=top_i.device) // block]


class Attention:
    def __init__(self, cfg: TextConfig, get: Getter, p: str, rope: Rope, sparse: bool):
        self.cfg, self.rope = cfg, rope
        self.wq, self.wk = linear(get, p + "q_proj"), linear(get, p + "k_proj")
        self.wv, self.wo = linear(get, p + "v_proj"), linear(get, p + "o_proj")
        self.q_norm, self.k_norm = get(p + "q_norm.weight"), get(p + "k_norm.weight")
        self.indexer = Indexer(cfg, get, p) if sparse else None
        idx = (self.indexer.wq, self.indexer.wk) if sparse else ()
        self.qkv = stack_linears(self.wq, self.wk, self.wv, *idx)  # [q; k; v (; index q; index k)] rows

    def decode(self, x: torch.Tensor, step: Step, cache: LayerCache) -> torch.Tensor:
        """The decode step of __call__ (T = 1 over a cache, CUDA) up to o_proj: x [B, 1, H] -> [B, 1, nq*d].
        Kernels: the stacked projection, norms + RoPE + cache writes, [indexer scores, top-k], attention."""
        cfg, B = self.cfg, x.shape[0]
        nq, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        if step.kv_len > cache.k.shape[2]:
            raise ValueError(f"KV cache holds {cache.k.shape[2]} tokens; {step.kv_len} needed (raise max_len)")
        cos, sin = step.rope(self.rope, x.dtype)  # [B, 1, r]
        pos = step.pos[:, 0]  # [B]
        qkv = self.qkv(x.reshape(B, -1))  # [B, nq*d + 2*nkv*d (+ ni*di + di)]
        ix, scores = self.indexer, None
        if ix is None:
            q, _ = fused.decode_qkv(qkv, pos, cos, sin, (self.q_norm, self.k_norm), (nq, nkv, d), cache.k, cache.v,
                                    eps)
        else:
            q, iq = fused.decode_qkv(qkv, pos, cos, sin, (self.q_norm, self.k_norm, ix.q_norm, ix.k_norm),
                                     (nq, nkv, d, ix.ni, ix.di), cache.k, cache.v, eps, cache.idx_k)
            scores = ix.scores_decode(iq, pos, step, cache)  # [B, ni, nblk] or None; index head h -> kv head h
        if scores is None:
            out = decode_attention(q, cache.k, cache.v, pos, step.kv_len, None, cfg.index_block_size, d ** -0.5)
        else:
            out, top = decode_attention_topk(q, cache.k, cache.v, pos, step.kv_len, scores, cfg.index_topk_blocks,
                                             cfg.index_block_size, d ** -0.5)  # [B, nq, d]
            ix.kept(top, step)
        return out.reshape(B, 1, nq * d)

    def __call__(self, x: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> torch.Tensor:
        cfg, (B, T, _) = self.cfg, x.shape
        nq, nkv, d, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
        cos, sin = step.rope(self.rope, x.dtype)  # [B, T, r]
        q = norm_rope(self.wq(x).view(B, T, nq, d), self.q_norm, eps, cos, sin)  # qk-norm, then RoPE
        k = norm_rope(self.wk(x).view(B, T, nkv, d), self.k_norm, eps, cos, sin)
        v = self.wv(x).view(B, T, nkv, d)
        if cache is None and not step.fresh:  # padded batch without a cache: a scratch one
            cache = LayerCache.empty(cfg, self.indexer is not None, B, step.kv_len, x.dtype, x.device)
        if cache is not None:
            cache.put("k", k, step)
            cache.put("v", v, step)
        top = self.indexer.select(x, cos, sin, step, cache) if self.indexer is not None else None
        if step.decode:
            blocks = None if top is None else top[:, :, 0].expand(B, nkv, -1)  # index head h -> kv head h
            out = decode_attention(q[:, 0], cache.k, cache.v, step.pos[:, 0], step.kv_len, blocks,
                                   cfg.index_block_size, d ** -0.5)  # [B, nq, d]
            return self.wo(out.reshape(B, 1, nq * d))
        S = step.kv_len
        if cache is None:  # fresh, no cache: the new keys are slots 0..T-1
            keys, vals = k.transpose(1, 2), v.transpose(1, 2)  # [B, nkv, T, d]
        else:
            keys, vals = cache.k[:, :, :S], cache.v[:, :, :S]  # [B, nkv, S, d]
        q = q.transpose(1, 2)  # [B, nq, T, d]
        if top is None and step.fresh:
            out = F.scaled_dot_product_attention(q, keys, vals, is_causal=True, scale=d ** -0.5, enable_gqa=True)
        else:
            causal = lambda: (torch.arange(S, device=x.device) <= step.pos[..., None])[:, None]  # [B, 1, T, S]
            mask = step.memo(("causal", S), causal)  # made once per forward, shared by the layers
            if top is not None:
                mask = mask & keep_mask(top, S, cfg.index_block_size)  # [B, ni, T, S]
            out = gqa_attention(q, keys, vals, mask, d ** -0.5)  # [B, nq, T, d]
        return self.wo(out.transpose(1, 2).reshape(B, T, nq * d))


def gqa_attention(q, k, v, mask, scale) -> torch.Tensor:
    """q [B, nq, T, d], k/v [B, nkv, S, d], mask bool [B, nkv|1, T, S] -> [B, nq, T, d] (no K/V repeat)."""
    B, nq, T, d = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nq // nkv  # query head h uses KV head h // g
    qg = q.reshape(B, nkv, g * T, d)
    m = mask.expand(B, nkv, T, S)[:, :, None].expand(B, nkv, g, T, S).reshape(B, nkv, g * T, S)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)  # [B, nkv, g*T, d]
    return out.reshape(B, nq, T, d)


# ---------------------------------------------------------------------------------------------------
# MLPs (docs/minimax-m3.md: SwiGLU-OAI, MoE block)


class MLP:
    """SwiGLU-OAI MLP (dense layers and the shared expert), alpha/beta/limit from the resolved config."""

    def __init__(self, cfg: TextConfig, get: Getter, p: str):
        self.gate, self.up = linear(get, p + "gate_proj"), linear(get, p + "up_proj")
        self.down = linear(get, p + "down_proj")
        self.gate_up = stack_linears(self.gate, self.up)  # [gate; up] rows: one GEMV + SwiGLU at decode
        # 0-dim tensors on the weights' device: a Python float would be copied to the GPU on every call,
        # which a CUDA graph cannot capture
        dev = self.down.weight.device
        self.params = (cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)  # floats for the fused kernel
        self.alpha, self.beta, self.limit = (torch.tensor(float(v), device=dev) for v in self.params)

    def __call__(self, x: torch.Tensor, add: tuple = ()) -> torch.Tensor:
        """x [..., H] -> [..., H]; add: tensors added to the output in order (fused into down's GEMV)."""
        if self.gate_up is not None and gemv.runs(x, self.gate_up.weight):
            act = gemv.gemv(x, self.gate_up.weight, self.gate_up.scale, swiglu=self.params)
        elif self.gate_up is not None and gemv.applies(x, self.gate_up.weight):  # one GEMV, then SwiGLU
            both = self.gate_up(x)  # [..., 2I]
            inter = both.shape[-1] // 2
            act = fused.swiglu(both[..., :inter], both[..., inter:], *self.params)
        else:
            gate, up = self.gate(x), self.up(x)
            if fused.use_triton(gate):
                act = fused.swiglu(gate, up, *self.params)
            else:
                act = swiglu_oai(gate, up, self.alpha, self.beta, self.limit)
        return self.down(act, add)


class MoE:
    """fp32 sigmoid router + routed experts through a runtime.moe backend (rsf applied there) + shared."""

    def __init__(self, cfg: TextConfig, get: Getter, p: str, device, make_backend: Callable):
        self.cfg = cfg
        self.routing = MoeRouting(router_weight=get(p + "gate.weight").float(),  # [E, H] fp32
                                  e_score_correction_bias=get(p + "e_score_correction_bias").float(),  # [E]
                                  top_k=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor)
        w13, w2 = p + "experts.w13_weight", p + "experts.w2_weight"
        quant = MoeQuantInfo(
            w13_weight=get(w13), w13_weight_scale=get(scale_name(w13)),  # [E, 2I, H]
            w2_weight=get(w2), w2_weight_scale=get(scale_name(w2)),  # [E, H, I]
            **make_swiglu_params(cfg.num_local_experts, cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit,
                                 device))
        self.experts = make_backend(quant, self.routing)
        # The layer holds the canonical tensors only through its backend: one that makes its own layout at
        # load (TRT-LLM's shuffled tensors, the Triton backend's rebase) keeps none, and the experts are
        # resident once.
        self.quant = getattr(self.experts, "quant", None)
        self.shared = MLP(cfg, get, p + "shared_experts.") if cfg.n_shared_experts else None

    def __call__(self, x: torch.Tensor, add: tuple = ()) -> torch.Tensor:
        """x [..., H] -> routed + shared [..., H], then + each of add in order."""
        flat = x.reshape(-1, x.shape[-1])  # [B*T, H]
        add = tuple(a.reshape(flat.shape) for a in add)
        side = self._side_stream(flat)
        if side is None:
            y = self.routed(flat)
            if self.shared is not None:
                return self.shared(flat, (y, *add)).view_as(x)  # y + shared expert (unscaled), then add
            for a in add:
                y = y + a
            return y.view_as(x)
        # Decode: the shared expert streams its weights on a second stream while the router and the routed
        # experts run on this one, filling each other's launch gaps and tails (both are bound by weight bytes).
        # Forked and joined inside the call, so every tensor the side stream touches outlives its use.
        with torch.cuda.stream(side):
            s = self.shared(flat)  # [B*T, H]
        y = self.routed(flat)
        _join(side)
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
        if not (MOE_OVERLAP and self.shared is not None and gemv.applies(flat, self.routing.router_weight)):
            return None
        return _fork(flat.device)


class DecoderLayer:
    def __init__(self, cfg: TextConfig, get: Getter, i: int, rope: Rope, device, make_backend: Callable):
        p = f"model.layers.{i}."
        self.index, self.eps, self.device = i, cfg.rms_norm_eps, torch.device(device)
        self.ln_in, self.ln_post = get(p + "input_layernorm.weight"), get(p + "post_attention_layernorm.weight")
        self.attn = Attention(cfg, get, p + "self_attn.", rope, cfg.is_sparse_attention(i))
        if cfg.is_moe(i):
            self.mlp = MoE(cfg, get, p + "block_sparse_moe.", device, make_backend)
        else:
            self.mlp = MLP(cfg, get, p + "mlp.")

    def __call__(self, h: torch.Tensor, positions, cache: Optional[LayerCache] = None,
                 valid: Optional[torch.Tensor] = None):
        """h [B, T, H] residual stream; positions: a Step, or absolute positions [T] / [B, T] (= cache slots)
        with valid [B, T] (False = pad token) -> [B, T, H] on this layer's device."""
        step = positions if isinstance(positions, Step) else Step.of(positions, h.shape[0], cache, valid)
        step, h = step.on(self.device), h.to(self.device)
        with on_device(self.device):
            if self.fused_decode(h, step, cache):
                a = self.attn.decode(rms_norm(h, self.ln_in, self.eps), step, cache)  # [B, 1, nq*d]
                wo = self.attn.wo
                if gemv.runs(a, wo.weight):  # the add in the GEMV's epilogue, then the norm
                    h = wo(a, add=(h,))  # h + o_proj(a)
                    x = rms_norm(h, self.ln_post, self.eps)
                else:  # one kernel adds the residual and norms the sum
                    h, x = fused.add_rms_norm(wo(a), h, self.ln_post, self.eps)
                return self.mlp(x, add=(h,))  # h + mlp(x)
            h = h + self.attn(rms_norm(h, self.ln_in, self.eps), step, cache)
            return h + self.mlp(rms_norm(h, self.ln_post, self.eps))

    def fused_decode(self, h: torch.Tensor, step: Step, cache: Optional[LayerCache]) -> bool:
        """Whether this step runs the fused decode kernels (see FUSED_DECODE)."""
        return (FUSED_DECODE and step.decode and cache is not None and self.attn.qkv is not None
                and fused.use_triton(h) and gemv.applies(h, self.attn.qkv.weight))


# ---------------------------------------------------------------------------------------------------
# Whole model


class MiniMaxM3:
    """`model(ids) -> logits`, `model.generate(ids, max_new_tokens)`; built by runtime.load.

    With a device_map, decoder layer i lives on layer_devices[i] (embeddings on the first device, final
    norm and lm_head on the last) and the residual stream moves between them."""

    def __init__(self, cfg: TextConfig, top: dict, layers, device, dtype, layer_devices=None):
        from runtime.text import GenerationConfig
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.tokenizer, self.generation_config = None, GenerationConfig()  # set by runtime.load
        self.embed_tokens, self.norm = top["model.embed_tokens.weight"], top["model.norm.weight"]  # [V, H], [H]
        self.lm_head = top.get("lm_head.weight", self.embed_tokens)  # [V, H] (tied if absent)
        self.layers = layers  # list of DecoderLayer, or runtime.loader.LazyLayers
        self.layer_devices = ([torch.device(d) for d in layer_devices] if layer_devices is not None
                              else [self.device] * cfg.num_hidden_layers)
        self.head_device = self.lm_head.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.embed_tokens.device)
        return F.embedding(ids, self.embed_tokens).to(self.dtype)  # [B, T, H]

    def final(self, h: torch.Tensor) -> torch.Tensor:
        with on_device(self.norm.device):
            h = rms_norm(h.to(self.norm.device), self.norm, self.cfg.rms_norm_eps)
        return F.linear(h.to(self.lm_head.device), self.lm_head.to(h.dtype)).float()  # [B, T, V]

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """Caches of max_len slots (rounded up to whole index blocks), each on its layer's device."""
        bs = self.cfg.index_block_size
        slots = -(-max_len // bs) * bs
        layers = [LayerCache.empty(self.cfg, self.cfg.is_sparse_attention(i), batch, slots, self.dtype,
                                   self.layer_devices[i])
                  for i in range(self.cfg.num_hidden_layers)]
        return KVCache(layers, torch.zeros(batch, dtype=torch.long, device=self.embed_tokens.device))

    def make_step(self, batch: int, T: int, cache: Optional[KVCache], attention_mask=None) -> Step:
        """Positions of T new tokens per row: each row continues at cache.next_pos; with an attention_mask
        ([B, T], 1 = real token, left padding) pad tokens get position 0 and are not cached."""
        dev = self.embed_tokens.device
        valid = None if attention_mask is None else attention_mask.to(dev).bool()
        if valid is not None and bool(valid.all()):
            valid = None
        start = cache.next_pos[:, None] if cache is not None else torch.zeros(batch, 1, dtype=torch.long, device=dev)
        if valid is None:
            pos = start + torch.arange(T, device=dev)  # [B, T]
        else:
            pos = torch.where(valid, start + valid.long().cumsum(1) - 1, 0)
        first = cache is None or cache.length == 0
        kv_len = (cache.length if cache is not None else 0) + T  # >= every row's last position + 1
        if cache is not None and kv_len > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} tokens; {kv_len} needed (raise max_len)")
        decode = cache is not None and T == 1 and valid is None
        if decode:  # whole index blocks (decode_attention walks the cache block by block)
            kv_len = min(-(-kv_len // self.cfg.index_block_size) * self.cfg.index_block_size, cache.max_len)
        return Step(pos, valid, kv_len, fresh=first and valid is None, decode=decode)

    def run_layers(self, h: torch.Tensor, step: Step, cache: Optional[KVCache], states: Optional[list] = None):
        for i in range(len(self.layers)):
            h = self.layers[i](h, step, cache.layers[i] if cache is not None else None)
            if states is not None:
                states.append(h)
        return h

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, cache: Optional[KVCache] = None, output_hidden_states=False,
                 attention_mask: Optional[torch.Tensor] = None):
        """input_ids [B, T] -> logits [B, T, V] fp32 (and the residual streams if asked). attention_mask
        [B, T] (1 real, 0 pad; left padding) runs prompts of different lengths together: each row's
        logits at its real tokens are what the row gives alone."""
        B, T = input_ids.shape
        step = self.make_step(B, T, cache, attention_mask)
        h = self.embed(input_ids)
        states = [h] if output_hidden_states else None
        h = self.run_layers(h, step, cache, states)
        if cache is not None:
            cache.length += T
            cache.next_pos += T if step.valid is None else step.valid.sum(1)
        logits = self.final(h)
        return (logits, states) if output_hidden_states else logits

    def generate(self, prompt, max_new_tokens=None, **options):
        """Continue prompts: text (a string or a list of them; chat=True applies the chat template) -> the
        completion text; ids (a LongTensor [B, T], a list of ints, or a list of lists) -> prompt + new ids.

        Defaults come from generation_config.json (EOS, max_new_tokens, sampling); options:
        eos_token_id, attention_mask, do_sample, temperature, top_p, top_k, seed, stop (strings),
        stream (callable(row, text) as text is generated), chat, cuda_graph (None: on CUDA whenever the
        step can be captured). See runtime/generation.py."""
        from runtime.generation import generate
        return generate(self, prompt, max_new_tokens, **options)

    def why_no_graph(self):
        """None if a decode step can be captured, else the reason."""
        from runtime.decode_graph import why_not
        return why_not(self)

    def decode_graph(self, cache):
        from runtime.decode_graph import DecodeGraph
        return DecodeGraph(self, cache)
