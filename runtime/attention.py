"""Decode attention (one new token per row) over the preallocated KV cache, with per-row positions.

The cache is position-indexed: slot s of row b holds that row's token at absolute position s, so a row
whose next token sits at position p attends to slots 0..p, whatever the other rows' lengths (padded
batches need no pad slots). Nothing is built per step from the key length: the caller passes a static
`kv_len` (the cache size under CUDA-graph capture), and validity is computed from `pos` on the device.

Two key sets:
  * dense: every slot in [0, kv_len) with slot <= pos[b];
  * sparse (lightning-indexer layers): only the key blocks the indexer selected, `blocks`
    [B, nkv, nb] block ids (entries >= ceil(kv_len / block) mark "none": fewer visible blocks than the
    budget).

`decode_attention` runs a split-K flash-decoding Triton kernel on CUDA (each program streams a slice of
the key list once, online softmax in fp32, then the slices are merged with their log-sum-exp), and an
SDPA reference elsewhere (same key set, additive mask, no boolean-mask path).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from runtime.fused import next_pow2, use_triton


def key_slots(pos: torch.Tensor, kv_len: int, blocks: Optional[torch.Tensor], block: int, nkv: int):
    """-> (slots [B, nkv, n] int64 to read, ok [B, nkv, n] bool): the key list of every (row, kv head)."""
    B = pos.shape[0]
    dev = pos.device
    if blocks is None:
        slots = torch.arange(kv_len, device=dev).expand(B, nkv, kv_len)  # [B, nkv, S]
        live = torch.ones_like(slots, dtype=torch.bool)
    else:
        nblk = -(-kv_len // block)
        live = (blocks < nblk)[..., None].expand(*blocks.shape, block)  # [B, nkv, nb, block]
        slots = blocks.clamp(max=nblk - 1)[..., None] * block + torch.arange(block, device=dev)
        slots, live = slots.flatten(2), live.flatten(2)  # [B, nkv, nb*block]
    return slots, live & (slots <= pos[:, None, None])


def decode_attention_reference(q, k_cache, v_cache, pos, kv_len: int, blocks=None, block: int = 1,
                               scale: float = 1.0) -> torch.Tensor:
    """q [B, nq, d], k/v_cache [B, nkv, S_max, d], pos [B] -> [B, nq, d] (SDPA, additive mask)."""
    B, nq, d = q.shape
    nkv = k_cache.shape[1]
    g = nq // nkv  # query head h uses KV head h // g
    slots, ok = key_slots(pos, kv_len, blocks, block, nkv)  # [B, nkv, n]
    idx = slots.clamp(max=k_cache.shape[2] - 1)[..., None].expand(*slots.shape, d)  # past pos: masked
    k = k_cache.gather(2, idx)  # [B, nkv, n, d]
    v = v_cache.gather(2, idx)
    bias = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(~ok, float("-inf"))
    out = F.scaled_dot_product_attention(q.view(B, nkv, g, d), k, v, attn_mask=bias[:, :, None, :],
                                         scale=scale)  # [B, nkv, g, d]
    return out.reshape(B, nq, d)


def decode_attention(q, k_cache, v_cache, pos, kv_len: int, blocks=None, block: int = 1,
                     scale: float = 1.0) -> torch.Tensor:
    """q [B, nq, d], k/v_cache [B, nkv, S_max, d], pos [B] (position of the new token = its slot, already
    written), blocks [B, nkv, nb] or None -> [B, nq, d] in q's dtype."""
    if use_triton(q):
        return _decode_attention_triton(q, k_cache, v_cache, pos, kv_len, blocks, block, scale)
    return decode_attention_reference(q, k_cache, v_cache, pos, kv_len, blocks, block, scale)


def num_splits(n_keys: int, programs: int, block_n: int, target: int = 264) -> int:
    """Split the key list so that about `target` (2 per SM on an H200) programs stream it."""
    tiles = max(1, -(-n_keys // block_n))
    return max(1, min(tiles, -(-target // max(programs, 1))))


def _decode_attention_triton(q, k_cache, v_cache, pos, kv_len, blocks, block, scale):
    from runtime.attention_triton import combine_kernel, decode_kernel
    B, nq, d = q.shape
    pos = pos.contiguous()  # the kernels read pos[b] at pos_ptr + b
    nkv = k_cache.shape[1]
    g = nq // nkv
    gp = max(16, next_pow2(g))  # tl.dot needs >= 16 rows
    block_n = 64
    if blocks is None:
        n_keys, nb, blk = kv_len, 0, pos  # blk unused (DENSE)
    else:
        nb = blocks.shape[-1]
        n_keys, blk = nb * block, blocks.contiguous()
    splits = num_splits(n_keys, B * nkv, block_n)
    tiles = -(-n_keys // block_n)
    tiles_per_split = -(-tiles // splits)
    o = torch.empty((B, nkv, splits, gp, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((2, B, nkv, splits, gp), dtype=torch.float32, device=q.device)
    qc = q.contiguous()
    decode_kernel[(B * nkv, splits)](
        qc, k_cache, v_cache, pos, blk, o, ml[0], ml[1],
        n_keys, -(-kv_len // block) if blocks is not None else 0, nb, tiles_per_split, scale,
        qc.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NKV=nkv, G=g, GP=gp, D=d, BLOCK_N=block_n, KB=block, DENSE=blocks is None,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    out = torch.empty((B, nq, d), dtype=q.dtype, device=q.device)  # query head h*g + i <- (kv head h, row i)
    combine_kernel[(B * nkv, g)](o, ml[0], ml[1], out, splits, GP=gp, G=g, D=d,
                                 SP=max(2, next_pow2(splits)), num_warps=4)
    return out
