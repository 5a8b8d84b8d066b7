"""Triton split-K decode attention over the position-indexed KV cache (see runtime/kernels/attention.py).

Program (row b, kv head h, slice sp) streams its slice of the key list in BLOCK_N-key tiles: the G query
heads that share kv head h are the rows of one tl.dot (padded to GP >= 16), scores and the online
softmax stay in fp32, K/V rows are read once. Dense: keys are slots 0..pos[b] (tiles past pos are not
visited). Sparse: key j of the list is slot blocks[b, h, j // KB] * KB + j % KB (any block size KB); with
TOPK the kernel picks those blocks itself from the indexer's block scores (the TOPK best, ranked in every
program: no separate top-k launch). Each slice writes its unnormalised output, running max and sum;
combine_kernel merges the slices.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    blk_ptr,
    sc_ptr,
    o_ptr,
    m_ptr,
    l_ptr,
    top_ptr,
    n_keys,
    nblk,
    nb,
    tiles_per_split,
    scale,
    sq_b,
    sk_b,
    sk_h,
    sk_s,
    sv_b,
    sv_h,
    sv_s,
    ss_b,
    ss_h,
    NKV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KB: tl.constexpr,
    DENSE: tl.constexpr,
    IEEE: tl.constexpr,
    TOPK: tl.constexpr = 0,
    NBP: tl.constexpr = 1,
    CH: tl.constexpr = 1,
    USE_PDL: tl.constexpr = False,
):
    """Grid (B * NKV, splits). Sparse with TOPK > 0: sc_ptr holds block scores [B, *, nblk] fp32 (row
    stride ss_b, head stride ss_h: 0 when one index head serves every kv head; NBP >= nblk, ranked CH
    columns at a time); slice 0 of each (row, kv head) also writes the picked blocks to top
    [B * NKV, TOPK] (best first, nblk = none). Without TOPK, blk_ptr holds the blocks [B, NKV, nb]."""
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the previous kernel's writes
        tl.extra.cuda.gdc_wait()
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    b = (bh // NKV).to(tl.int64)  # b x cache stride passes 2^31 at long contexts and batch
    h = bh % NKV
    p = tl.load(pos_ptr + b)
    rows = tl.arange(0, GP)
    dcol = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * sq_b + (h * G + rows)[:, None] * D + dcol[None, :], mask=(rows < G)[:, None], other=0.0
    )  # [GP, D]
    if TOPK > 0:
        rank, live = _block_ranks(sc_ptr + b * ss_b + h * ss_h, nblk, NBP, CH)  # [NBP] each
        bidx = tl.arange(0, NBP)
        if sp == 0:
            tl.store(
                top_ptr + bh * TOPK + rank,
                tl.where(live, bidx, nblk).to(tl.int64),
                mask=(rank < TOPK) & (bidx < nblk),
            )
    m_i = tl.full([GP], -1.0e30, tl.float32)  # finite "minus infinity": an empty slice merges with weight 0
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    t0 = sp * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(n_keys, BLOCK_N))
    if DENSE:
        t1 = tl.minimum(t1, tl.cdiv(p + 1, BLOCK_N))  # tiles past the row's position hold nothing
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h
    for t in range(t0, t1):
        j = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if DENSE:
            slot = j
            ok = j <= p
        else:
            if TOPK > 0:
                if KB % BLOCK_N == 0:  # the tile lies in one list entry: one scalar pick
                    hit = live & (rank == (t * BLOCK_N) // KB)  # [NBP]
                    bid = tl.where(tl.sum(hit.to(tl.int32), 0) > 0, tl.sum(tl.where(hit, bidx, 0), 0), nblk)
                else:
                    hit = live[None, :] & (rank[None, :] == (j // KB)[:, None])  # [BLOCK_N, NBP]
                    bid = tl.where(
                        tl.sum(hit.to(tl.int32), 1) > 0, tl.sum(tl.where(hit, bidx[None, :], 0), 1), nblk
                    )
            else:
                bid = tl.load(blk_ptr + bh * nb + j // KB, mask=j < n_keys, other=nblk)
            slot = tl.minimum(bid, nblk - 1) * KB + j % KB
            ok = (j < n_keys) & (bid < nblk) & (slot <= p)
        k = tl.load(k_base + slot[:, None] * sk_s + dcol[None, :], mask=ok[:, None], other=0.0)  # [BN, D]
        v = tl.load(v_base + slot[:, None] * sv_s + dcol[None, :], mask=ok[:, None], other=0.0)  # [BN, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * scale, float("-inf"))  # [GP, BN]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if IEEE:
            pv = tl.dot(pr, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pr.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = (bh * nsp + sp) * GP + rows
    tl.store(o_ptr + out[:, None] * D + dcol[None, :], acc)
    tl.store(m_ptr + out, m_i)
    tl.store(l_ptr + out, l_i)


@triton.jit
def _block_ranks(s_row, NBLK, NBP: tl.constexpr, CH: tl.constexpr):
    """Ranks of NBLK block scores (0 = best; equal scores: lower block first, the order of a sequential
    argmax with tie_break_left) and which are visible (score > -inf): [NBP] each. NBP^2 compares, CH
    columns at a time."""
    i = tl.arange(0, NBP)
    v = tl.load(s_row + i, mask=i < NBLK, other=float("-inf"))
    rank = tl.zeros([NBP], tl.int32)
    for c in tl.static_range(0, NBP, CH):
        jj = c + tl.arange(0, CH)
        vj = tl.load(s_row + jj, mask=jj < NBLK, other=float("-inf"))
        ahead = (vj[None, :] > v[:, None]) | (
            (vj[None, :] == v[:, None]) & (jj[None, :] < i[:, None])
        )  # [NBP, CH]
        rank += tl.sum(ahead.to(tl.int32), 1)
    return rank, (v > float("-inf")) & (i < NBLK)


@triton.jit
def combine_kernel(
    o_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    NSP,
    GP: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    SP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Merge the slices of (row b, kv head h) for query head h * G + gi:
    sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    bh = tl.program_id(0)
    gi = tl.program_id(1)
    s = tl.arange(0, SP)
    dcol = tl.arange(0, D)
    ok = s < NSP
    idx = (bh * NSP + s) * GP + gi  # [SP]
    m = tl.load(m_ptr + idx, mask=ok, other=-1.0e30)
    l = tl.load(l_ptr + idx, mask=ok, other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # empty slices (m = -1e30) weigh 0
    o = tl.load(o_ptr + idx[:, None] * D + dcol[None, :], mask=ok[:, None], other=0.0)  # [SP, D]
    out = tl.sum(o * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + (bh * G + gi) * D + dcol, out.to(out_ptr.dtype.element_ty))
