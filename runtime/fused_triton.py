"""Triton kernels of runtime/fused.py: one launch for what the reference does in 5-10 small torch ops
(at decode a layer is bound by launches, not bytes, once the weights stream at full speed)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    """Gemma RMSNorm of one row: fp32, x * rsqrt(mean(x^2) + eps) * (1 + w), stored in y's dtype."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    tl.store(y_ptr + row * N + cols, (x * rstd * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, NH, D, R, eps, BLOCK: tl.constexpr):
    """Per (token, head): per-head Gemma RMSNorm over D channels, rounded to the compute dtype (as the
    reference), then NeoX RoPE on channels [0, R) with the token's cos/sin [R]; the rest pass through."""
    pid = tl.program_id(0)  # token * NH + head
    tok = pid // NH
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    base = x_ptr + pid * D
    x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    half = R // 2
    rot = cols < R
    partner = tl.where(cols < half, cols + half, cols - half)
    xp = tl.load(base + partner, mask=rot, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    y = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
    yp = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + tok * R + cols, mask=rot, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * R + cols, mask=rot, other=0.0).to(tl.float32)
    sign = tl.where(cols < half, -1.0, 1.0)
    out = tl.where(rot, y * c + sign * yp * s, y)
    tl.store(y_ptr + pid * D + cols, out.to(dt), mask=ok)


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
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = g * tl.sigmoid(alpha * g) * (u + beta)
    tl.store(y_ptr + idx, y.to(y_ptr.dtype.element_ty), mask=ok)
