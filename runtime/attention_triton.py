"""Triton split-K decode attention over the position-indexed KV cache (see runtime/attention.py).

Program (row b, kv head h, slice sp) streams its slice of the key list in BLOCK_N-key tiles: the G query
heads that share kv head h are the rows of one tl.dot (padded to GP >= 16), scores and the online
softmax stay in fp32, K/V rows are read once. Dense: keys are slots 0..pos[b] (tiles past pos are not
visited). Sparse: key j of the list is slot blocks[b, h, j // KB] * KB + j % KB (any block size KB).
Writes the slice's unnormalised output, running max and sum; decode_attention merges the slices.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, blk_ptr, o_ptr, m_ptr, l_ptr,
                  n_keys, nblk, nb, tiles_per_split, scale,
                  sq_b, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                  NKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, KB: tl.constexpr, DENSE: tl.constexpr, IEEE: tl.constexpr):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    nsp = tl.num_programs(1)
    b = bh // NKV
    h = bh % NKV
    p = tl.load(pos_ptr + b)
    rows = tl.arange(0, GP)
    dcol = tl.arange(0, D)
    q = tl.load(q_ptr + b * sq_b + (h * G + rows)[:, None] * D + dcol[None, :],
                mask=(rows < G)[:, None], other=0.0)  # [GP, D]
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
            bid = tl.load(blk_ptr + bh * nb + j // KB, mask=j < n_keys, other=nblk)
            slot = tl.minimum(bid, nblk - 1) * KB + j % KB
            ok = (j < n_keys) & (bid < nblk) & (slot <= p)
        k = tl.load(k_base + slot[:, None] * sk_s + dcol[None, :], mask=ok[:, None], other=0.0)  # [BN, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * scale, float("-inf"))  # [GP, BN]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(v_base + slot[:, None] * sv_s + dcol[None, :], mask=ok[:, None], other=0.0)  # [BN, D]
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
def combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, NSP, GP: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   SP: tl.constexpr):
    """Merge the slices of (row b, kv head h) for query head h * G + gi: sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s."""
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
