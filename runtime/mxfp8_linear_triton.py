"""Triton kernel of runtime/mxfp8_linear.py (weights dequantized in registers, fp32 accumulation)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mxfp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, sxm, swn, ssn, sym,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rs = tl.arange(0, BK // 32)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):  # K is a multiple of BK (checked by the caller)
        x = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + rn[:, None] * swn + (k0 + rk)[None, :], mask=n_ok[:, None], other=0.0)  # [BN, BK] e4m3
        sc = tl.load(s_ptr + rn[:, None] * ssn + (k0 // 32 + rs)[None, :], mask=n_ok[:, None], other=127)
        mult = tl.exp2(sc.to(tl.float32) - 127.0)  # [BN, BK/32]; byte 0 only on all-zero blocks
        wf = tl.reshape(tl.reshape(w.to(tl.float32), (BN, BK // 32, 32)) * mult[:, :, None], (BN, BK))
        if IEEE:
            acc += tl.dot(x, tl.trans(wf), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(wf.to(x.dtype)))
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
