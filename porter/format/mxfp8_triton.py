"""porter.format.mxfp8's quantize_with_error as one Triton kernel for `porter convert --device cuda`,
opt-in with PORTER_CUDA_QUANTIZE=fused (porter.pipeline.fused_quantizer says why it is not the default).

The torch path on the GPU runs ~75 small ops per tensor (and a device sync for the finiteness check). Here a
tensor costs two launches: `_quantize_blocks_kernel` quantizes [BLOCKS, 32] tiles and writes each
program's float64 partial error sums, `_reduce_partials_kernel` adds those up in a fixed order (deterministic:
the same statistics on every run). The rule is porter.format.mxfp8's, step for step:

- block amax in fp32 (exact), the scale byte from its bits (mxfp8._scale_field: rceil or floor), an all-zero or
  subnormal amax gives byte 0;
- x * 2^(127 - byte) (exact), floor's values clipped to +-448, then the round-to-nearest-even cast to e4m3
  (cvt.rn.satfinite: nothing above 448 reaches it);
- error pieces per block in fp32 (||w||^2, ||x - q||^2, max |x - q|), scaled back by 2^(byte-127) and summed in
  float64 (mxfp8._error_totals).

The bytes equal mxfp8.quantize_with_error's (GPU tests: every finite bf16 value, tests/test_mxfp8_triton.py;
every tensor of a converted checkpoint, tests/test_convert.py); the sums differ from the torch path's only in
summation order. Inputs it does not take (other dtypes, kept scale bytes of an MXFP8 source, empty tensors)
go through the torch path.
"""
from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from porter.format import mxfp8

BLOCKS_PER_PROGRAM = 128  # [128, 32] tile: 4096 elements per program
REDUCE_CHUNK = 1024
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_launch_lock = threading.Lock()  # conversion workers launch from many threads; Triton's compile cache is not
# meant to be filled concurrently, and a launch is ~20 us of host time, so launches simply take turns


@triton.jit
def _quantize_blocks_kernel(w_ptr, q_ptr, scale_ptr, part_ptr, nb,
                            FLOOR: tl.constexpr, BLOCKS: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid * BLOCKS + tl.arange(0, BLOCKS)  # [B] block index
    live = blk < nb
    offs = blk.to(tl.int64)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [B, 32]
    w = tl.load(w_ptr + offs, mask=live[:, None], other=0.0).to(tl.float32)  # exact widening
    # NaN and Inf: x - x is 0 for every finite x, NaN otherwise; counted, the host refuses the tensor
    nonfinite = tl.sum(tl.sum(((w - w) != 0).to(tl.int32), axis=1), axis=0)
    amax = tl.max(tl.abs(w), axis=1)  # [B]
    bits = amax.to(tl.int32, bitcast=True)
    if FLOOR:
        k = bits >> 23
    else:
        k = (bits + 0x1FFFFF) >> 23  # rceil: the add carries into the exponent iff the mantissa > 0.75
    byte = tl.maximum(k - 8, 0)  # [B] int32 in [0, 247]
    mult = ((254 - byte) << 23).to(tl.float32, bitcast=True)  # 2^(127 - byte), exponent field in [7, 254]
    x = w * mult[:, None]  # exact power-of-two scaling
    if FLOOR:
        q = tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    tl.store(q_ptr + offs, q, mask=live[:, None])
    tl.store(scale_ptr + blk, byte.to(tl.uint8), mask=live)
    # error pieces, per block in fp32 as mxfp8._quantize_blocks, then float64 in the original domain
    d = x - q.to(tl.float32)  # scaled-domain error, exact (x unclipped: floor's clipping is in it)
    err_sq = tl.sum(d * d, axis=1)  # [B]
    ref_sq = tl.sum(w * w, axis=1)
    d_max = tl.max(tl.abs(d), axis=1)
    e = byte.to(tl.int64)
    step = ((e + 896) << 52).to(tl.float64, bitcast=True)  # 2^(byte-127) as float64 bits
    step_sq = ((2 * e + 769) << 52).to(tl.float64, bitcast=True)
    err = tl.sum(tl.where(live, err_sq.to(tl.float64) * step_sq, 0.0), axis=0)
    ref = tl.sum(tl.where(live, ref_sq.to(tl.float64), 0.0), axis=0)
    mx = tl.max(tl.where(live, d_max.to(tl.float64) * step, 0.0), axis=0)
    tl.store(part_ptr + pid * 4 + 0, err)
    tl.store(part_ptr + pid * 4 + 1, ref)
    tl.store(part_ptr + pid * 4 + 2, mx)
    tl.store(part_ptr + pid * 4 + 3, nonfinite.to(tl.float64))


@triton.jit
def _reduce_partials_kernel(part_ptr, out_ptr, n, CHUNK: tl.constexpr):
    """One program: [n, 4] partials -> out[4] = (sum err, sum ref, max of max, sum nonfinite), in a fixed order."""
    i = tl.arange(0, CHUNK)
    err = tl.zeros([CHUNK], tl.float64)
    ref = tl.zeros([CHUNK], tl.float64)
    mx = tl.zeros([CHUNK], tl.float64)
    bad = tl.zeros([CHUNK], tl.float64)
    for start in tl.range(0, n, CHUNK):
        m = start + i < n
        row = (start + i) * 4
        err += tl.load(part_ptr + row + 0, mask=m, other=0.0)
        ref += tl.load(part_ptr + row + 1, mask=m, other=0.0)
        mx = tl.maximum(mx, tl.load(part_ptr + row + 2, mask=m, other=0.0))
        bad += tl.load(part_ptr + row + 3, mask=m, other=0.0)
    tl.store(out_ptr + 0, tl.sum(err, axis=0))
    tl.store(out_ptr + 1, tl.sum(ref, axis=0))
    tl.store(out_ptr + 2, tl.max(mx, axis=0))
    tl.store(out_ptr + 3, tl.sum(bad, axis=0))


def supports(w: torch.Tensor, keep_scale=None) -> bool:
    """Whether quantize_with_error here takes w (else use mxfp8.quantize_with_error)."""
    return (keep_scale is None and w.is_cuda and w.dtype in _DTYPES and w.numel() > 0 and w.is_contiguous()
            and w.shape[-1] % mxfp8.BLOCK == 0)


def quantize_with_error(w: torch.Tensor, rounding: str = "rceil", name: str = "tensor"):
    """w [..., K] on a CUDA device -> (q [..., K] e4m3, scale [..., K/32] uint8, stats float64 [4] on the
    device: err_sq, ref_sq, max_abs_error, count of non-finite elements). Asynchronous: nothing waits for the
    device here, so the caller refuses the tensor (mxfp8.nonfinite_error) when stats[3] != 0 on the host."""
    mxfp8._check_rounding(rounding)
    if not supports(w):
        raise mxfp8.MXFP8Error(f"{name}: the fused GPU quantizer takes contiguous bf16/fp16/fp32 CUDA tensors "
                               f"with K % 32 == 0, not {w.dtype} {tuple(w.shape)} on {w.device}")
    nb = w.numel() // mxfp8.BLOCK
    programs = triton.cdiv(nb, BLOCKS_PER_PROGRAM)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((*w.shape[:-1], w.shape[-1] // mxfp8.BLOCK), dtype=torch.uint8, device=w.device)
    part = torch.empty((programs, 4), dtype=torch.float64, device=w.device)
    stats = torch.empty(4, dtype=torch.float64, device=w.device)
    with _launch_lock:
        _quantize_blocks_kernel[(programs,)](w, q, scale, part, nb, FLOOR=rounding == "floor",
                                             BLOCKS=BLOCKS_PER_PROGRAM, num_warps=4)
        _reduce_partials_kernel[(1,)](part, stats, programs, CHUNK=REDUCE_CHUNK, num_warps=4)
    return q, scale, stats


def warm_up(device: torch.device, rounding: str) -> None:
    """Build (or load from Triton's cache) the kernels a conversion launches, with the specialization of a
    real bf16 part (a block count divisible by 16), and wait for them: raises where this GPU or Triton cannot
    run them."""
    w = torch.zeros(16, 4 * mxfp8.BLOCK, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize(device)
    quantize_with_error(w, rounding, "warm-up")[2].cpu()
