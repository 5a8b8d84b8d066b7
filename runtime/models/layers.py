"""Building blocks of the runtime's models: linears (stored as is or MXFP8, with an optional bias), RMSNorm
(Gemma or plain), partial NeoX RoPE (plain or YaRN), masked GQA attention and the side stream the shared expert
overlaps on. Each op runs its Triton kernel on CUDA (runtime.kernels) and a torch reference elsewhere."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from porter.format import mxfp8
from porter.format.layout import scale_name
from runtime.kernels import fused, gemv

Getter = Callable[[str], Optional[torch.Tensor]]  # canonical name -> tensor on the device, or None
_SIDE_STREAMS: dict = {}  # device index -> the shared expert's stream (one decoding thread per device)


def fork(device: torch.device) -> torch.cuda.Stream:
    """The device's second stream, ordered after everything launched so far on the current one."""
    if device.index not in _SIDE_STREAMS:
        _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    side = _SIDE_STREAMS[device.index]
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def join(side: torch.cuda.Stream) -> None:
    """Order what comes next on the current stream after everything launched on side."""
    torch.cuda.current_stream(side.device).wait_stream(side)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """RMSNorm in fp32, scaled by (offset + w), cast back to x's dtype (one kernel on CUDA). offset 1.0:
    Gemma's norm (the weight stores a delta); 0.0: the plain RMSNorm (y * w)."""
    if fused.use_triton(x):
        return fused.rms_norm(x, w, eps, offset)
    return rms_norm_reference(x, w, eps, offset)


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 1.0) -> torch.Tensor:
    """rms_norm in torch ops on any device (what the kernel is checked against)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (offset + w.float())).to(x.dtype)


def on_device(device: torch.device):
    """Make `device` current while a layer runs: Triton launches on the current device's stream, so a
    layer on cuda:1 launched with cuda:0 current would race its own inputs (device_map)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()  # already current (one GPU adds no context switch), or CPU


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Linear:
    """y = x W^T with W stored as is (bf16/fp32) or MXFP8 (e4m3 + uint8 scales). On CUDA with few rows
    (decode) MXFP8 runs one GEMV kernel (runtime.kernels.gemv) that streams the 1-byte weights once, dequantized
    in registers (16-bit weights too where gemv.runs says it pays); elsewhere the weight is cast or
    dequantized per call, then multiplied; a 16-bit weight against one row runs runtime.kernels.gemv.gemv_stream
    (faster than cuBLAS there). add: tensors [..., N] added to the output in order, in its
    dtype (residual adds; fused into the GEMV's epilogue when it runs). bias [N]: added first, in the output's
    dtype (F.linear's order), before any of add.

    mxfp8_act (the serving numerics, set by runtime.load): an MXFP8 weight's input is first rounded to MXFP8
    along K as the engines' W8A8 MXFP8 linear quantizes it (docs/moe-backends.md, "Serving numerics")."""

    def __init__(
        self, weight: torch.Tensor, scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None
    ):
        self.weight, self.scale, self.bias = weight, scale, bias
        self.mxfp8_act = False

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """x as this linear multiplies it: rounded to MXFP8 values in the serving numerics, else as given."""
        if self.mxfp8_act and self.scale is not None:
            return mxfp8.fake_quantize_activations(x, name="linear input")
        return x

    def __call__(self, x: torch.Tensor, add: tuple = ()) -> torch.Tensor:
        x = self.input(x)
        if self.bias is not None:  # the bias first, then the adds in order
            return add_in_order(self._project(x, ()) + self.bias.to(x.dtype), add)
        return self._project(x, add)

    def _project(self, x: torch.Tensor, add: tuple) -> torch.Tensor:
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
    if (
        add
        and len(add) <= 2
        and fused.use_triton(y)
        and all(a.shape == y.shape and a.dtype == y.dtype for a in add)
    ):
        return fused.add_chain(y, *add)
    for a in add:
        y = y + a
    return y


def linear(get: Getter, name: str, bias: bool = False) -> Linear:
    """The Linear `name` (`name.weight`, its scale when quantized, `name.bias` when bias)."""
    return Linear(
        get(name + ".weight"), get(scale_name(name + ".weight")), get(name + ".bias") if bias else None
    )


def stack_linears(*parts: Linear) -> Optional[Linear]:
    """One Linear whose weight rows are the parts' rows stacked (linears of the same input: at decode one
    kernel streams them all). Each part keeps a view of its rows, so no weight is stored twice. None when
    they cannot share a kernel (weights not on CUDA, mixed dtypes, devices or quantization)."""
    ws = [p.weight for p in parts]
    if (
        not all(fused.use_triton(w) for w in ws)
        or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1
        or len({p.scale is None for p in parts}) != 1
    ):
        return None
    w = torch.cat(ws)  # [sum N, K]
    s = None if parts[0].scale is None else torch.cat([p.scale for p in parts])  # [sum N, K/32]
    row = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight, p.scale = w[row : row + n], None if s is None else s[row : row + n]
        row += n
    return Linear(w, s)


class Rope:
    """cos/sin of positions. Plain RoPE by default (inv_freq from theta); YaRN passes its own inv_freq and
    attention scaling (yarn_inv_freq), which multiplies cos and sin (transformers' attention_scaling)."""

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        device,
        inv_freq: Optional[torch.Tensor] = None,
        attention_scaling: float = 1.0,
    ):
        if inv_freq is None:  # same formula as transformers (compute_default_rope_parameters)
            inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.inv_freq, self.scaling = inv_freq.to(device), float(attention_scaling)

    def __call__(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = (
            self.inv_freq if self.inv_freq.device == positions.device else self.inv_freq.to(positions.device)
        )
        freqs = positions[..., None].float() * inv  # [B, T, r/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, r]
        if self.scaling == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    original_max_position_embeddings: int,
    truncate: bool,
) -> torch.Tensor:
    """YaRN's inverse frequencies [dim/2]: the extrapolated (theta) and interpolated (theta, positions / factor)
    frequencies blended by a linear ramp over the dims that turn between beta_fast and beta_slow times in
    the original context (arXiv 2309.00071; as transformers 5.23 _compute_yarn_parameters)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate (slow dims)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, n, d], cos/sin [B, T, r]; rotates channels [0, r), NeoX rotate_half; the rest pass through."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, r]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rot = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rot, rest], dim=-1)


def norm_rope(
    x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Per-head qk-norm, then RoPE: x [B, T, n, d] -> [B, T, n, d] (one kernel on CUDA)."""
    if fused.use_triton(x):
        return fused.norm_rope(x, w, eps, cos, sin)
    return apply_rope(rms_norm(x, w, eps), cos, sin)


def keep_mask(top_i: torch.Tensor, S: int, block: int) -> torch.Tensor:
    """top blocks [B, ni, T, topk] (nblk = none) -> bool [B, ni, T, S] keys of the selected blocks."""
    nblk = -(-S // block)
    sel = torch.zeros(*top_i.shape[:-1], nblk + 1, dtype=torch.bool, device=top_i.device)
    sel = sel.scatter_(-1, top_i, True)[..., :nblk]  # [B, ni, T, nblk]
    return sel[..., torch.arange(S, device=top_i.device) // block]


def causal_attention(q, k, v, cache, step, keep=None) -> torch.Tensor:
    """Prefill (and padded-batch) attention of a grouped-query layer: q [B, T, nq, d] and this step's k / v
    [B, T, nkv, d] -> [B, T, nq*d], over the cache's first kv_len slots (already holding k / v) or, fresh
    without a cache, over the new keys. keep(S) -> bool [B, nkv|1, T, S] narrows the causal mask (sparse
    attention's selected blocks); without it a fresh step takes SDPA's own causal path."""
    B, T, nq, d = q.shape
    S = step.kv_len
    if cache is None:  # fresh, no cache: the new keys are slots 0..T-1
        keys, vals = k.transpose(1, 2), v.transpose(1, 2)  # [B, nkv, T, d]
    else:
        keys, vals = cache.k[:, :, :S], cache.v[:, :, :S]  # [B, nkv, S, d]
    q = q.transpose(1, 2)  # [B, nq, T, d]
    if keep is None and step.fresh:
        out = F.scaled_dot_product_attention(q, keys, vals, is_causal=True, scale=d**-0.5, enable_gqa=True)
    else:
        causal = lambda: (torch.arange(S, device=q.device) <= step.pos[..., None])[:, None]  # [B, 1, T, S]
        mask = step.memo(("causal", S), causal)  # made once per forward, shared by the layers
        if keep is not None:
            mask = mask & keep(S)  # [B, nkv, T, S]
        out = gqa_attention(q, keys, vals, mask, d**-0.5)  # [B, nq, T, d]
    return out.transpose(1, 2).reshape(B, T, nq * d)


def gqa_attention(q, k, v, mask, scale) -> torch.Tensor:
    """q [B, nq, T, d], k/v [B, nkv, S, d], mask bool [B, nkv|1, T, S] -> [B, nq, T, d] (no K/V repeat)."""
    B, nq, T, d = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nq // nkv  # query head h uses KV head h // g
    qg = q.reshape(B, nkv, g * T, d)
    m = mask.expand(B, nkv, T, S)[:, :, None].expand(B, nkv, g, T, S).reshape(B, nkv, g * T, S)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)  # [B, nkv, g*T, d]
    return out.reshape(B, nq, T, d)
