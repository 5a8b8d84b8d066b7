"""Triton kernels of runtime/kernels/fused.py: one launch for what the reference does in 5-10 small torch ops
(at decode a layer is bound by launches, not bytes, once the weights stream at full speed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    a_ptr,
    hout_ptr,
    N,
    eps,
    offset,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """RMSNorm of one row: fp32, x * rsqrt(mean(x^2) + eps) * (offset + w), stored in y's dtype (offset 1:
    Gemma's norm, 0: the plain one).
    ADD: x is first the residual add hout = x + a rounded to hout's dtype (the torch add), and the norm is
    taken of that rounded sum, as the unfused ops compute it."""
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the previous kernel's writes
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0)
    if ADD:
        a = tl.load(a_ptr + row * N + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(hout_ptr.dtype.element_ty)
        tl.store(hout_ptr + row * N + cols, x, mask=ok)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(
        y_ptr + row * N + cols, (x * _rstd(x, N, eps) * (offset + w)).to(y_ptr.dtype.element_ty), mask=ok
    )


@triton.jit
def _rstd(x, N, eps):
    """1 / sqrt(mean(x^2) + eps) of an fp32 row whose padding is 0."""
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)


@triton.jit
def swiglu_oai(g, u, alpha, beta, limit):
    """SwiGLU-OAI of fp32 gate/up values: min(g, limit) * sigmoid(alpha * min(g, limit)) *
    (clamp(u, -limit, limit) + beta), in fp32 (swiglu_kernel and gemv_kernel's epilogue)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + beta)


@triton.jit
def add_chain_kernel(
    x0_ptr, x1_ptr, x2_ptr, y_ptr, n, THREE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False
):
    """y = (x0 + x1) [+ x2], rounded to y's dtype after each add (the torch adds, one kernel)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    dt = y_ptr.dtype.element_ty
    y = (tl.load(x0_ptr + idx, mask=ok).to(tl.float32) + tl.load(x1_ptr + idx, mask=ok).to(tl.float32)).to(dt)
    if THREE:
        y = (y.to(tl.float32) + tl.load(x2_ptr + idx, mask=ok).to(tl.float32)).to(dt)
    tl.store(y_ptr + idx, y, mask=ok)


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, NH, D, R, eps, BLOCK: tl.constexpr):
    """Per (token, head): per-head Gemma RMSNorm over D channels, rounded to the compute dtype (as the
    reference), then NeoX RoPE on channels [0, R) with the token's cos/sin [R]; the rest pass through."""
    pid = tl.program_id(0)  # token * NH + head
    tok = pid // NH
    _norm_rope_row(
        x_ptr + pid * D,
        w_ptr,
        cos_ptr + tok * R,
        sin_ptr + tok * R,
        y_ptr + pid * D,
        D,
        R,
        eps,
        y_ptr.dtype.element_ty,
        BLOCK,
    )


@triton.jit
def swiglu_kernel(g_ptr, u_ptr, y_ptr, N, I, sg, su, alpha, beta, limit, BLOCK: tl.constexpr):
    """SwiGLU-OAI: min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + beta)."""
    pid = tl.program_id(0)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    row = idx // I
    col = idx % I
    g = tl.load(g_ptr + row * sg + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + idx, swiglu_oai(g, u, alpha, beta, limit).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope_row(src, w_ptr, cos_row, sin_row, dst, D, R, eps, dt: tl.constexpr, BLOCK: tl.constexpr):
    """Per-head Gemma RMSNorm + NeoX RoPE of one head vector: src [D] -> dst [D] (any pointers; used by
    norm_rope_kernel and decode_qkv_kernel)."""
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = _rstd(x, D, eps)
    half = R // 2
    rot = cols < R
    partner = tl.where(cols < half, cols + half, cols - half)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    y = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
    yp = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)
    c = tl.load(cos_row + cols, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_row + cols, mask=rot, other=0.0).to(tl.float32)
    sign = tl.where(cols < half, -1.0, 1.0)
    out = tl.where(rot, y * c + sign * yp * s, y)
    tl.store(dst + cols, out.to(dt), mask=ok)


@triton.jit
def decode_qkv_kernel(
    qkv_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    qn_ptr,
    kn_ptr,
    iqn_ptr,
    ikn_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    iq_ptr,
    ic_ptr,
    s_qkv,
    s_cs,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    sib,
    sis,
    NQ,
    NKV,
    NI,
    D,
    DI,
    R,
    RI,
    eps,
    INDEX: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """One decode token per row b, one head vector per program (b, slot) of the fused projection row
    [q heads | k heads | v heads | (index q heads | index k)]: q -> qk-norm + RoPE -> q [B, NQ, D];
    k -> qk-norm + RoPE -> k cache slot pos[b]; v -> v cache slot pos[b]; index q -> norm + RoPE ->
    iq [B, NI, DI]; index k -> norm + RoPE -> index-key cache slot pos[b]. The unfused step runs the
    same per-head math (norm_rope_kernel) and writes the cache by index_put."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)  # b x cache stride passes 2^31 at long contexts and batch
    slot = tl.program_id(1)
    dt = q_ptr.dtype.element_ty
    p = tl.load(pos_ptr + b).to(tl.int64)
    row = qkv_ptr + b * s_qkv
    cos_row = cos_ptr + b * s_cs
    sin_row = sin_ptr + b * s_cs
    if slot < NQ:
        _norm_rope_row(
            row + slot * D, qn_ptr, cos_row, sin_row, q_ptr + (b * NQ + slot) * D, D, R, eps, dt, BLOCK
        )
    elif slot < NQ + NKV:
        h = slot - NQ
        _norm_rope_row(
            row + slot * D,
            kn_ptr,
            cos_row,
            sin_row,
            kc_ptr + b * skb + h * skh + p * sks,
            D,
            R,
            eps,
            dt,
            BLOCK,
        )
    elif slot < NQ + 2 * NKV:
        h = slot - NQ - NKV
        cols = tl.arange(0, BLOCK)
        v = tl.load(row + slot * D + cols, mask=cols < D, other=0.0)
        tl.store(vc_ptr + b * svb + h * svh + p * svs + cols, v.to(vc_ptr.dtype.element_ty), mask=cols < D)
    else:
        if INDEX:
            base = row + (NQ + 2 * NKV) * D
            i = slot - NQ - 2 * NKV
            if i < NI:
                _norm_rope_row(
                    base + i * DI,
                    iqn_ptr,
                    cos_row,
                    sin_row,
                    iq_ptr + (b * NI + i) * DI,
                    DI,
                    RI,
                    eps,
                    dt,
                    BLOCK,
                )
            else:
                _norm_rope_row(
                    base + NI * DI,
                    ikn_ptr,
                    cos_row,
                    sin_row,
                    ic_ptr + b * sib + p * sis,
                    DI,
                    RI,
                    eps,
                    dt,
                    BLOCK,
                )


@triton.jit
def index_scores_kernel(
    iq_ptr,
    ic_ptr,
    pos_ptr,
    out_ptr,
    S,
    NBLK,
    sib,
    sis,
    NI: tl.constexpr,
    NIP: tl.constexpr,
    DI: tl.constexpr,
    DIP: tl.constexpr,
    KB: tl.constexpr,
    KBP: tl.constexpr,
    LOCAL: tl.constexpr,
    INIT: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Block scores of one decode query per row: program (b, block j) -> out [B, NI, NBLK] fp32 =
    max over the block's visible slots (slot < S, slot <= pos[b]) of iq[b, h] . index_key[slot]; -inf
    when none is visible; +inf for the blocks every query keeps (its own block and the LOCAL-1 before
    it, the first INIT blocks already started)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)  # b x cache stride passes 2^31 at long contexts and batch
    j = tl.program_id(1)
    p = tl.load(pos_ptr + b)
    hrow = tl.arange(0, NIP)
    qb = p // KB
    forced = (j <= qb) & ((j > qb - LOCAL) | (j < INIT))
    if j * KB > p:
        best = tl.full([NIP], float("-inf"), tl.float32)
    else:
        dcol = tl.arange(0, DIP)
        d_ok = dcol < DI
        q = tl.load(
            iq_ptr + (b * NI + hrow)[:, None] * DI + dcol[None, :],
            mask=(hrow < NI)[:, None] & d_ok[None, :],
            other=0.0,
        )
        s_idx = j * KB + tl.arange(0, KBP)
        ok = (tl.arange(0, KBP) < KB) & (s_idx < S) & (s_idx <= p)
        k = tl.load(
            ic_ptr + b * sib + s_idx[:, None].to(tl.int64) * sis + dcol[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [KBP, DIP]
        if IEEE:
            sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))  # bf16 products are exact in fp32
        sc = tl.where(ok[None, :], sc, float("-inf"))
        best = tl.max(sc, 1)  # [NIP]
    best = tl.where(forced, float("inf"), best)
    tl.store(out_ptr + (b * NI + hrow) * NBLK + j, best, mask=hrow < NI)


@triton.jit
def index_topk_kernel(
    scores_ptr, out_ptr, NBLK, TOPK: tl.constexpr, NBP: tl.constexpr, USE_PDL: tl.constexpr = False
):
    """Program (b, index head): the TOPK best of NBLK block scores, best first; a pick whose score is
    -inf (nothing visible left) is written as NBLK ("none"), as the unfused topk + masked_fill."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    idx = tl.arange(0, NBP)
    v = tl.load(scores_ptr + pid * NBLK + idx, mask=idx < NBLK, other=float("-inf"))
    for t in tl.static_range(TOPK):
        m = tl.max(v, 0)
        i = tl.argmax(v, 0, tie_break_left=True)
        tl.store(out_ptr + pid * TOPK + t, tl.where(m == float("-inf"), NBLK, i).to(tl.int64))
        v = tl.where(idx == i, float("-inf"), v)


@triton.jit
def router_select_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    w_ptr,
    E,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    EP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Routing of one token from its fp32 router logits [E] (runtime.moe.contract.SIGMOID_BIAS_TOPK): sigmoid
    scores, top-k of score + bias (bias for selection only), weights = the selected scores renormalised."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0)
    e = tl.arange(0, EP)
    ok = e < E
    score = tl.sigmoid(tl.load(logits_ptr + t * E + e, mask=ok, other=0.0))
    key = tl.where(ok, score + tl.load(bias_ptr + e, mask=ok, other=0.0), float("-inf"))
    k = tl.arange(0, KP)  # KP = TOPK rounded up to a power of two
    ids = tl.zeros([KP], tl.int64)
    wts = tl.zeros([KP], tl.float32)
    for i in tl.static_range(TOPK):
        best = tl.argmax(key, 0, tie_break_left=True)
        ids = tl.where(k == i, best, ids)
        wts = tl.where(k == i, tl.sum(tl.where(e == best, score, 0.0), 0), wts)
        key = tl.where(e == best, float("-inf"), key)
    tl.store(ids_ptr + t * TOPK + k, ids, mask=k < TOPK)
    tl.store(w_ptr + t * TOPK + k, wts / tl.sum(wts, 0), mask=k < TOPK)


@triton.jit
def router_logits_kernel(
    x_ptr, w_ptr, out_ptr, M, E, K, sxm, BM: tl.constexpr, BK: tl.constexpr, USE_PDL: tl.constexpr = False
):
    """Program e: fp32 router logits out[m, e] = x[m] . w[e] for every row m (x in its dtype, taken to
    fp32 exactly; w fp32 [E, K] streamed once, one row per program so E programs share the read). The first
    weight tile is requested before the PDL wait: the weight does not depend on the previous kernel."""
    e = tl.program_id(0)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    w_row = w_ptr + e.to(tl.int64) * K
    w = tl.load(w_row + rk, mask=rk < K, other=0.0)  # [BK]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BM, BK], tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        x = tl.load(
            x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc += x.to(tl.float32) * w[None, :]
        if k0 + BK < K:
            w = tl.load(w_row + k0 + BK + rk, mask=(k0 + BK + rk) < K, other=0.0)
    tl.store(out_ptr + rm * E + e, tl.sum(acc, 1), mask=m_ok)
