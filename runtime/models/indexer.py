"""The sparse-attention indexer of MiniMax-M3: scores KV blocks per query and picks the blocks attention
reads (facts: docs/minimax-m3.md, the forward pass section). Shapes as in runtime/models/minimax_m3.py."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from converters.minimax_m3 import TextConfig
from runtime.cache import LayerCache, Step
from runtime.kernels import fused
from runtime.models.layers import Getter, capturing, linear, norm_rope


class Indexer:
    def __init__(self, cfg: TextConfig, get: Getter, p: str):
        self.q_proj, self.k_proj = linear(get, p + "index_q_proj"), linear(get, p + "index_k_proj")
        self.q_norm, self.k_norm = get(p + "index_q_norm.weight"), get(p + "index_k_norm.weight")
        self.cfg, self.ni, self.di = cfg, cfg.index_n_heads, cfg.index_head_dim
        self._dropped: Optional[torch.Tensor] = None  # 0-dim count behind last_excluded, left on the device

    def linears(self) -> list:
        return [self.q_proj, self.k_proj]

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
        iq = norm_rope(self.q_proj(x).view(B, T, self.ni, self.di), self.q_norm, eps, cos, sin)  # [B,T,ni,di]
        ik = norm_rope(self.k_proj(x).view(B, T, 1, self.di), self.k_norm, eps, cos, sin)[:, :, 0]  # [B,T,di]
        S = step.kv_len
        if cache is not None:
            cache.put("idx_k", ik, step)
            ik = cache.idx_k[:, :S]  # [B, S, di]
        bs, topk = self.cfg.index_block_size, self.cfg.index_topk_blocks
        nblk = -(-S // bs)
        if not capturing():
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
        if not capturing():
            self._dropped = self._excluded(top_i, nblk, pos // bs + 1, step.valid)
        return top_i

    def scores_decode(self, iq: torch.Tensor, pos: torch.Tensor, step: Step, cache: LayerCache):
        """select() at decode up to the block scores, after fused.decode_qkv wrote the new index key:
        iq [B, ni, di] (normed, RoPE'd) -> [B, ni, nblk] fp32, or None (every visible block fits the
        budget). The attention picks the top-k (runtime.kernels.attention.decode_attention_topk), then kept()."""
        nblk = -(-step.kv_len // self.cfg.index_block_size)
        if not capturing():
            self._dropped = None
        if nblk <= self.cfg.index_topk_blocks:
            return None
        return fused.index_scores(
            iq,
            cache.idx_k,
            pos,
            step.kv_len,
            self.cfg.index_block_size,
            self.cfg.index_local_blocks,
            self.cfg.index_init_blocks,
        )

    def kept(self, top: torch.Tensor, step: Step) -> None:
        """The blocks the decode attention kept, top [B, ni, topk] (diagnostics: last_excluded)."""
        if not capturing():
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
