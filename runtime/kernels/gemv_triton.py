"""Triton kernel of runtime/kernels/gemv.py: y = x W^T for few rows, the weight streamed once, epilogues fused.

One program owns BN output columns (ROWS weight rows: BN, or BN gate + BN up rows with SWIGLU) over
the whole K: no split-K, so no partial-sum hand-off and one fixed summation order (CUDA-graph replay
and eager launch give the same bits). The x rows are padded to BM >= 16 for tl.dot (x is a few KB and
stays in L1/L2; the weight tile is the stream). MXFP8 weights are dequantized per [ROWS, BK] tile as
e4m3 * 2^(byte - 127), built from the byte by an exponent shift (no exp2 per element), which is exact
in bf16 and fp32 for bytes 1..254; byte 0 (only on all-zero blocks, < 448 * 2^-127) decodes to 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels.fused_triton import swiglu_oai


@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    a1_ptr,
    a2_ptr,
    M,
    N,
    K,
    sxm,
    swn,
    ssn,
    sym,
    sa1,
    sa2,
    alpha,
    beta,
    limit,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    ROWS: tl.constexpr,
    MX: tl.constexpr,
    IEEE: tl.constexpr,
    EVEN_K: tl.constexpr,
    SWIGLU: tl.constexpr,
    ADDS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """x [M, K], W [Nw, K] (N output columns; SWIGLU: W = [gate; up], Nw = 2N) -> y [M, N].

    SWIGLU: y = SwiGLU-OAI(round(x Wg^T), round(x Wu^T)) (the rounding the unfused gate/up linears do).
    ADDS 1: y = round(round(x W^T) + a1); ADDS 2: y = round(round(round(x W^T) + a1) + a2): the bf16 adds
    of the unfused model (residual, routed + shared expert), in its order."""
    if USE_PDL:  # launched early (programmatic dependent launch): wait for the previous kernel's writes
        tl.extra.cuda.gdc_wait()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    m_ok = rm < M
    r = tl.arange(0, ROWS)
    if SWIGLU:
        col = pid_n * BN + r % BN
        wrow = col + (r // BN) * N  # BN gate rows, then the BN matching up rows
    else:
        col = pid_n * BN + r
        wrow = col
    wrow = tl.where(col < N, wrow, 0).to(tl.int64)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]  # padding rows (>= M) are masked: no memory traffic
    w_ptrs = w_ptr + wrow[:, None] * swn + rk[None, :]
    s_ptrs = s_ptr + wrow[:, None] * ssn + tl.arange(0, BK // 32)[None, :]
    acc = tl.zeros((BM, ROWS), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        if MX:
            if EVEN_K:
                s = tl.load(s_ptrs).to(tl.int32)  # [ROWS, BK/32]
            else:
                s = tl.load(s_ptrs, mask=((k0 // 32 + tl.arange(0, BK // 32)) < K // 32)[None, :], other=0)
                s = s.to(tl.int32)
            sf = (s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127); byte 0 -> 0
            w = tl.reshape(tl.reshape(w.to(tl.float32), (ROWS, BK // 32, 32)) * sf[:, :, None], (ROWS, BK))
        if IEEE:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        x_ptrs += BK
        w_ptrs += BK
        s_ptrs += BK // 32
    dt = y_ptr.dtype.element_ty
    cols = pid_n * BN + tl.arange(0, BN)
    if SWIGLU:
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        y = swiglu_oai(acc_g.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), alpha, beta, limit).to(dt)
    else:
        y = acc.to(dt)
    ok = m_ok[:, None] & (cols < N)[None, :]
    if ADDS >= 1:
        a1 = tl.load(a1_ptr + rm[:, None] * sa1 + cols[None, :], mask=ok, other=0.0)
        y = (y.to(tl.float32) + a1.to(tl.float32)).to(dt)
    if ADDS >= 2:
        a2 = tl.load(a2_ptr + rm[:, None] * sa2 + cols[None, :], mask=ok, other=0.0)
        y = (y.to(tl.float32) + a2.to(tl.float32)).to(dt)
    tl.store(y_ptr + rm[:, None] * sym + cols[None, :], y, mask=ok)


@triton.jit
def gemv_stream_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    sxm,
    swn,
    sym,
    MP: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """x [M, K] (M <= MP <= 4), W [N, K] 16-bit -> y [M, N], without MMA: each program streams BN weight
    rows over the whole K straight into registers and keeps [MP, BN, BK] fp32 partial products, summed
    once at the end (no shared-memory staging, no padding of x to 16 rows). With PDL the first weight
    tile is requested before waiting for the previous kernel: the weight does not depend on it."""
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    wrow = tl.where(rows < N, rows, 0).to(tl.int64)
    rk = tl.arange(0, BK)
    rm = tl.arange(0, MP)
    m_ok = rm < M
    w_ptrs = w_ptr + wrow[:, None] * swn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :]
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros((MP, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_ok[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BK
        x_ptrs += BK
        if k0 + BK < K:  # the next tile (the loop's loads are issued ahead of the math by the compiler)
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(
                    w_ptrs, mask=((k0 + BK + rk) < K)[None, :], other=0.0, eviction_policy="evict_first"
                )
    y = tl.sum(acc, axis=2)  # [MP, BN]
    cols = pid * BN + tl.arange(0, BN)
    tl.store(
        y_ptr + rm[:, None] * sym + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=m_ok[:, None] & (cols < N)[None, :],
    )
