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
SDPA reference elsewhere (same key set, additive mask, no boolean-mask path). `decode_attention_topk`
takes the indexer's block scores instead of the blocks and keeps the top-k: up to RANK_BLOCKS blocks the
split-K kernel picks them itself, every program ranking the scores (two launches after the indexer's
scores; faster, docs/runtime-decode.md); past that the index_topk kernel picks them first (three launches,
bit-equal).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from runtime.kernels import fused
from runtime.kernels.fused import next_pow2, pdl, use_triton

RANK_BLOCKS = 256  # the kernel ranks up to this many block scores per program (NBP^2 compares)
BLOCK_N = 64  # keys per tile of the split-K kernel (128 was no faster on the H200: docs/runtime-decode.md)


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


def decode_attention_reference(
    q, k_cache, v_cache, pos, kv_len: int, blocks=None, block: int = 1, scale: float = 1.0
) -> torch.Tensor:
    """q [B, nq, d], k/v_cache [B, nkv, S_max, d], pos [B] -> [B, nq, d] (SDPA, additive mask)."""
    B, nq, d = q.shape
    nkv = k_cache.shape[1]
    g = nq // nkv  # query head h uses KV head h // g
    slots, ok = key_slots(pos, kv_len, blocks, block, nkv)  # [B, nkv, n]
    idx = slots.clamp(max=k_cache.shape[2] - 1)[..., None].expand(*slots.shape, d)  # past pos: masked
    k = k_cache.gather(2, idx)  # [B, nkv, n, d]
    v = v_cache.gather(2, idx)
    bias = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(~ok, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.view(B, nkv, g, d), k, v, attn_mask=bias[:, :, None, :], scale=scale
    )  # [B, nkv, g, d]
    return out.reshape(B, nq, d)


def decode_attention(
    q, k_cache, v_cache, pos, kv_len: int, blocks=None, block: int = 1, scale: float = 1.0
) -> torch.Tensor:
    """q [B, nq, d], k/v_cache [B, nkv, S_max, d], pos [B] (position of the new token = its slot, already
    written), blocks [B, nkv, nb] or None -> [B, nq, d] in q's dtype."""
    if use_triton(q):
        return _decode_attention_triton(q, k_cache, v_cache, pos, kv_len, blocks, block, scale)[0]
    return decode_attention_reference(q, k_cache, v_cache, pos, kv_len, blocks, block, scale)


def top_blocks(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Block scores [B, n, nblk] -> the topk best blocks [B, n, topk] int64, best first (equal scores: lower
    block first; a pick whose score is -inf is nblk = none): the torch reference of the kernels' pick."""
    vals, idx = scores.sort(dim=-1, descending=True, stable=True)
    return idx[..., :topk].masked_fill(vals[..., :topk] == float("-inf"), scores.shape[-1])


def decode_attention_topk(
    q,
    k_cache,
    v_cache,
    pos,
    kv_len: int,
    scores: torch.Tensor,
    topk: int,
    block: int,
    scale: float = 1.0,
    rank_blocks: int = RANK_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_attention over the topk best blocks of the indexer's block scores [B, n, nblk] fp32 (n = nkv:
    index head h serves kv head h; n = 1: one serves all; nblk = ceil(kv_len / block) > topk) ->
    (out [B, nq, d], the blocks kept [B, n, topk] as top_blocks picks them). rank_blocks: the split-K kernel
    ranks up to this many blocks itself (0: always the index_topk kernel first; tests compare both)."""
    B, n, nblk = scores.shape
    nkv = k_cache.shape[1]
    if n not in (1, nkv):  # the kernel would read index heads past n
        raise ValueError(f"decode_attention_topk: {n} index heads for {nkv} kv heads (needs 1 or {nkv})")
    if use_triton(q) and topk < nblk <= min(rank_blocks, RANK_BLOCKS):
        out, top = _decode_attention_triton(
            q, k_cache, v_cache, pos, kv_len, None, block, scale, scores=scores, topk=topk
        )
        return out, top[:, :n]
    top = fused.index_topk(scores, topk) if use_triton(q) else top_blocks(scores, topk)  # [B, n, topk]
    out = decode_attention(q, k_cache, v_cache, pos, kv_len, top.expand(B, nkv, topk), block, scale)
    return out, top


def num_splits(n_keys: int, programs: int, block_n: int, target: int = 264) -> int:
    """Split the key list so that about `target` (2 per SM on an H200) programs stream it."""
    tiles = max(1, -(-n_keys // block_n))
    return max(1, min(tiles, -(-target // max(programs, 1))))


def _decode_attention_triton(q, k_cache, v_cache, pos, kv_len, blocks, block, scale, scores=None, topk=0):
    """-> (out [B, nq, d], top [B, nkv, topk] or None). scores: the kernel picks the topk blocks."""
    from runtime.kernels.attention_triton import combine_kernel, decode_kernel

    B, nq, d = q.shape
    pos = pos.contiguous()  # the kernels read pos[b] at pos_ptr + b
    nkv = k_cache.shape[1]
    g = nq // nkv
    gp = max(16, next_pow2(g))  # tl.dot needs >= 16 rows
    dense = blocks is None and scores is None
    nblk = 0 if dense else -(-kv_len // block)
    nb = 0 if dense else (topk if scores is not None else blocks.shape[-1])
    n_keys = kv_len if dense else nb * block
    splits = num_splits(n_keys, B * nkv, BLOCK_N)
    tiles = -(-n_keys // BLOCK_N)
    tiles_per_split = -(-tiles // splits)
    splits = -(-tiles // tiles_per_split)  # no slice without a tile
    dev = q.device
    o = torch.empty((B, nkv, splits, gp, d), dtype=torch.float32, device=dev)
    ml = torch.empty((2, B, nkv, splits, gp), dtype=torch.float32, device=dev)
    qc = q.contiguous()
    blk = blocks.contiguous() if blocks is not None else pos  # pos: unused
    sc = scores.contiguous() if scores is not None else ml  # ml: unused
    top = torch.empty((B, nkv, topk), dtype=torch.int64, device=dev) if scores is not None else None
    nbp = next_pow2(nblk) if scores is not None else 1
    decode_kernel[(B * nkv, splits)](
        qc,
        k_cache,
        v_cache,
        pos,
        blk,
        sc,
        o,
        ml[0],
        ml[1],
        top if top is not None else pos,
        n_keys,
        nblk,
        nb,
        tiles_per_split,
        scale,
        qc.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        sc.stride(0),
        sc.stride(1) if scores is not None and scores.shape[1] > 1 else 0,
        NKV=nkv,
        G=g,
        GP=gp,
        D=d,
        BLOCK_N=BLOCK_N,
        KB=block,
        DENSE=dense,
        IEEE=q.dtype == torch.float32,
        TOPK=topk if scores is not None else 0,
        NBP=nbp,
        CH=max(1, min(nbp, 4096 // nbp)),
        num_warps=4,
        num_stages=2,
        **pdl(dev),
    )  # CH: the ranking compares [NBP, CH] scores at a time (4096: no spills at NBP 256)
    out = torch.empty((B, nq, d), dtype=q.dtype, device=dev)  # query head h*g + i <- (kv head h, row i)
    combine_kernel[(B * nkv, g)](
        o, ml[0], ml[1], out, splits, GP=gp, G=g, D=d, SP=max(2, next_pow2(splits)), num_warps=4, **pdl(dev)
    )
    return out, top
