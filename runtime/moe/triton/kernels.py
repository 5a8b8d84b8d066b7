"""Triton kernels of the Hopper (SM90, runs on SM80+) MXFP8 fused MoE.

Weights: w13 [E, 2I, H] / w2 [E, H, I] float8_e4m3fn, K contiguous, either rebased at load to one fp32
power-of-two scale per row (runtime/moe/triton/prepare.py, the default where row_scale_ok holds: WMODE 7 / 5)
or as stored with one UE8M0 byte per 32 along K (WMODE 1..4). Two ways to multiply them
(config.default_config picks per T; the modes are named in config.WMode / config.Quant):
  * W8A16 (decode and small prefill): the weight tile is converted in registers to fp16 (rebased:
    e4m3 -> fp16 only, the row scale applied to the accumulator; as stored: e4m3 * 2^(s-127)), as the
    RHS of an fp16 MMA (fp32 accumulate); activations in fp16.
  * FP8 (prefill): activations are quantized per token to e4m3 with a power-of-two scale (one or
    two e4m3 terms, see _quant_row); the weights rebased to one power-of-two scale per row (WMODE 5:
    the load-time tensors, or a copy made at first use when the weights are kept as stored) or per
    (row, 128 K) (WMODE 4; prepare.rebase_fp8: a power-of-two shift of the stored e4m3
    values) feed the fp8 MMA. WMODE 5 chains the MMAs over the whole K
    and applies the row scale in the epilogue; WMODE 4 multiplies each 128-wide K step's fp32
    partial by its block scale before it joins the accumulator, which also bounds how long the fp8
    MMA accumulates on its own (Hopper's fp8 MMA accumulates with fewer bits than fp32; the token
    scale is applied in the epilogue either way). One fp8 MMA per 32-wide MXFP8 group is slower than
    W8A16, hence the rebase. Error and speed of each mode: docs/moe-backends.md, docs/performance.md.
Launches per forward (see launch.fused_moe):
  * T <= 4 tokens (NOSORT): prescale (T programs), GEMM1 (+ SwiGLU-OAI), GEMM2 (+ routing weight,
    top-k reduce by atomics; for one token into a persistent zeroed fp32 scratch with the bf16
    output written by the last arriver per (token, N tile): no alignment, no zeroing, no cast
    kernel; for 2..4 tokens into an fp32 output zeroed by the prescale kernel, then a cast).
  * larger T: prep (align + prescale/quantize + zero the fp32 output), GEMM1, [FP8: act quantize],
    GEMM2 (atomics), cast.
  On SM90 the GEMMs are launched with programmatic dependent launch (griddepcontrol.wait first
  thing in the kernel), which hides most of the launch gap between kernels. In serving numerics at
  NOSORT the prep kernel hands over at its start and GEMM1 prefetches weight lines before its wait
  (_prefetch_slab).
Serving numerics (MXFP8_ACT; docs/moe-backends.md, "On the Triton backend"): the prep kernel rounds each input
row and GEMM1's epilogue its bf16 SwiGLU output to MXFP8 values (_mxfp8_round, FlashInfer's rule bit for
bit); the W8A16 GEMMs multiply them exactly, the FP8 path as one e4m3 term per row with WMODE 6.
No split-K: one program owns each output tile for the whole K (split-K does not pay once the dequant is
hoisted; docs/moe-backends.md), so no partial-sum hand-off.

fp16 range guards of the W8A16 path (fp16 is exact for every e4m3 * 2^(s-127) only for bytes s in
[112, 134]):
  * weights: per expert a power-of-two offset d_e is folded out of the scale bytes (s - d_e) and
    2^d_e multiplied back in the fp32 epilogue. Exact when the expert's bytes (ignoring byte 0 =
    all-zero block) span <= 22 octaves; otherwise that GEMM runs in bf16 (exact for bytes 1..254).
  * activations into GEMM1: each token is scaled by 2^-m (m from its amax, so amax lands in
    [2^14, 2^15)) when cast to fp16, and 2^m is multiplied back in the epilogue (exact).
  * activations into GEMM2: SwiGLU-OAI output is bounded by max(|limit|, 0.2785/alpha) * (|limit| +
    |beta|) (56 for MiniMax-M3); act is stored in fp16 when that bound is below 2^15 for every expert,
    else (e.g. limit = inf) act is stored in bf16 and GEMM2 runs in bf16.
Byte 0 decodes to 0 here (not 2^-127): such a block is below 448 * 2^-127 and cannot matter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _align(
    topk_ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    cursor_ptr,
    N,
    E,
    MAXB,
    BM: tl.constexpr,
    EP: tl.constexpr,
    C: tl.constexpr,
    CB: tl.constexpr,
):
    """One program: stable counting sort of the N routed slots by expert, each expert padded to BM.

    sorted_ptr [MAXB*BM] gets slot ids (token*k + j), N on padding; expert_ids_ptr [MAXB] gets the
    expert of each BM block, E past the last used block. cursor_ptr [EP] int32 is scratch."""
    bins = tl.arange(0, EP)
    counts = tl.zeros([EP], dtype=tl.int32)
    for c0 in range(0, N, C):  # pass 1: histogram (padding lanes go to the spare bin EP-1 >= E)
        offs = c0 + tl.arange(0, C)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < N, other=EP - 1).to(tl.int32)
        counts += tl.histogram(ids, EP)
    counts = tl.where(bins < E, counts, 0)
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, pad_end - padded)
    for b0 in range(0, MAXB, CB):  # expert of block b: how many experts end at or before b*BM
        b = b0 + tl.arange(0, CB)
        ends_before = (pad_end[None, :] <= (b * BM)[:, None]) & (bins < E)[None, :]  # [CB, EP]
        tl.store(expert_ids_ptr + b, tl.sum(ends_before.to(tl.int32), axis=1), mask=b < MAXB)
    for p0 in range(0, MAXB * BM, CB):
        p = p0 + tl.arange(0, CB)
        tl.store(sorted_ptr + p, tl.zeros([CB], dtype=tl.int32) + N, mask=p < MAXB * BM)
    tl.debug_barrier()
    lane = tl.arange(0, C)
    for c0 in range(0, N, C):  # pass 2: position = expert cursor + rank among earlier equal ids
        offs = c0 + lane
        valid = offs < N
        ids = tl.load(topk_ids_ptr + offs, mask=valid, other=EP - 1).to(tl.int32)
        same = (ids[:, None] == ids[None, :]) & (lane[None, :] < lane[:, None])  # [C, C]
        rank = tl.sum(same.to(tl.int32), axis=1)
        base = tl.load(cursor_ptr + ids, mask=valid, other=0)
        tl.store(sorted_ptr + base + rank, offs, mask=valid)
        tl.debug_barrier()  # every lane has read the cursor before it moves
        cur = tl.load(cursor_ptr + bins)
        tl.store(cursor_ptr + bins, cur + tl.histogram(ids, EP))
        tl.debug_barrier()


@triton.jit
def _pow2_shift(amax, TOP: tl.constexpr):
    """(2^-m, 2^m) as exact fp32 with amax * 2^-m in [2^TOP, 2^(TOP+1)) (m from amax's exponent
    field; 2^0 for amax == 0)."""
    expo = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 amax), normal
    shift = tl.where(amax > 0, expo - TOP, 0)
    shift = tl.minimum(tl.maximum(shift, -100), 100)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2^-shift, exact
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def _act_shift(xscale, e, bound_ptr, alpha_ptr, beta_ptr, limit_ptr):
    """(2^-k, 2^k) per routed row [BM], exact fp32 powers of two with |SwiGLU-OAI| * 2^-k < 2^15, for
    configs whose parameters do not bound act (prepare.act_bounds: plain SwiGLU, limit = inf). xscale [BM]:
    the rows' prep scales 2^m (|x| < 2^(m+15)). GEMM1 and GEMM2 both call this on the same values and get
    the same k (exact min / max / products; one explicit fma), so GEMM2 undoes exactly GEMM1's scaling."""
    xb = xscale * 32768.0
    b = bound_ptr + e * 4  # [G, Gb, U, Ub] of expert e
    gate_b = tl.fma(xb, tl.load(b), tl.load(b + 1))
    up_b = tl.fma(xb, tl.load(b + 2), tl.load(b + 3))
    alpha = tl.load(alpha_ptr + e)
    lim = tl.abs(tl.load(limit_ptr + e))
    neg = tl.where(alpha > 0, 0.2785 / alpha, float("inf"))  # bound of |g sigmoid(alpha g)| at g < 0
    bound = tl.minimum(gate_b, tl.maximum(lim, neg)) * (tl.minimum(up_b, lim) + tl.abs(tl.load(beta_ptr + e)))
    expo = ((bound.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 bound) (0: -127)
    k = tl.minimum(tl.maximum(expo - 14, 0), 100)
    down = ((127 - k) << 23).to(tl.float32, bitcast=True)
    up = ((127 + k) << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def _mxfp8_round(x, R: tl.constexpr, C: tl.constexpr):
    """fp32 x [R, C] (C % 32 == 0) -> the values the serving kernel's GEMM reads after quantizing x to
    MXFP8 along C (porter.format.mxfp8.quantize_activations, then dequantized), bit for bit: per 32
    values the UE8M0 byte is the round-up of fl(amax / 448) (byte 0 when that quotient is at most
    2^-127: the block becomes zeros), the values x * 2^(127 - byte) rounded to e4m3 (RNE); a block
    holding NaN or Inf becomes NaN."""
    b = tl.reshape(x, (R, C // 32, 32))
    # one reduction per block: NaN and Inf count as +Inf, so a block holding one has amax == Inf (and a
    # finite block a finite amax)
    amax = tl.max(tl.where((b != b) | (tl.abs(b) == float("inf")), float("inf"), tl.abs(b)), axis=2)
    bad = amax == float("inf")  # [R, C/32]
    q = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)).to(tl.int32, bitcast=True)
    expo, mant = (q >> 23) & 0xFF, q & 0x7FFFFF
    byte = tl.where(expo == 0, (mant > 0x400000).to(tl.int32), expo + (mant != 0).to(tl.int32))
    byte = tl.minimum(byte, 253)  # finite fp32 amax stays below 247
    inv = tl.where(byte == 0, 0, (254 - byte) << 23).to(tl.float32, bitcast=True)  # 2^(127-byte), 0 for 0
    scale = (byte << 23).to(tl.float32, bitcast=True)  # 2^(byte-127) (byte 0: its values are 0 anyway)
    e4m3 = (b * inv[:, :, None]).to(tl.float8e4nv).to(tl.float32)
    out = tl.where((byte == 0)[:, :, None], 0.0, e4m3 * scale[:, :, None])  # +0, as the zeroed codes
    out = tl.where(bad[:, :, None], float("nan"), out)
    return tl.reshape(out, (R, C))


@triton.jit
def mxfp8_round_kernel(x_ptr, y_ptr, C, CP: tl.constexpr):
    """One row per program: y = _mxfp8_round(x) (tests; the MoE kernels apply it in their prologue and
    epilogue)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CP)
    x = tl.load(x_ptr + r * C + offs, mask=offs < C, other=0.0).to(tl.float32)
    y = tl.reshape(_mxfp8_round(tl.reshape(x, (1, CP)), 1, CP), (CP,))
    tl.store(y_ptr + r * C + offs, y.to(y_ptr.dtype.element_ty), mask=offs < C)


@triton.jit
def _quant_row(x, q_ptr, lo_ptr, scale_ptr, offs, mask, QUANT: tl.constexpr):
    """Store one fp32 row x as the MMA operand, with its power-of-two scale 2^m at scale_ptr.

    QUANT 1: fp16 x * 2^-m, amax in [2^14, 2^15) (exact; keeps fp16 MMA operands in range).
    QUANT 2: e4m3 hi = rne(x * 2^-m), amax in [2^7, 2^8) (e4m3 max 448).
    QUANT 3: QUANT 2 plus a second e4m3 term lo = rne(x * 2^-m - hi) at lo_ptr: hi + lo carries ~8
    significant bits (e4m3 alone 4), so a bf16 row is nearly exact.
    QUANT 4: bf16 x with scale 1 (a row already rounded to MXFP8 values: exact in bf16)."""
    amax = tl.max(tl.abs(x), axis=0)
    if QUANT == 4:
        down, up = 1.0, 1.0
        tl.store(q_ptr + offs, x.to(tl.bfloat16), mask=mask)
    elif QUANT == 1:
        down, up = _pow2_shift(amax, 14)
        tl.store(q_ptr + offs, (x * down).to(tl.float16), mask=mask)
    else:
        down, up = _pow2_shift(amax, 7)
        xs = x * down
        hi = xs.to(tl.float8e4nv)
        tl.store(q_ptr + offs, hi, mask=mask)
        if QUANT == 3:
            tl.store(lo_ptr + offs, (xs - hi.to(tl.float32)).to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr, up)


@triton.jit
def prep_kernel(
    hidden_ptr,
    xq_ptr,
    xlo_ptr,
    xscale_ptr,
    out_ptr,
    topk_ids_ptr,
    sorted_ptr,
    expert_ids_ptr,
    cursor_ptr,
    T,
    H,
    N,
    E,
    MAXB,
    stride_h,
    DO_ALIGN: tl.constexpr,
    QUANT: tl.constexpr,
    ZERO_OUT: tl.constexpr,
    HP: tl.constexpr,
    BM: tl.constexpr,
    EP: tl.constexpr,
    C: tl.constexpr,
    CB: tl.constexpr,
    MXFP8_ACT: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """With DO_ALIGN: program 0 aligns the tokens and programs 1..T handle tokens 0..T-1; without it
    programs 0..T-1 do. Per token: its MMA operand row with its power-of-two scale (QUANT > 0, see
    _quant_row) and its fp32 output row zeroed for GEMM2's atomics (ZERO_OUT; the fused-output path
    keeps a persistent zeroed scratch instead). MXFP8_ACT (serving numerics): the row is first rounded to
    the MXFP8 values the serving kernel reads (_mxfp8_round). Launched without PDL: it made the one-token
    layer slower (docs/moe-backends.md). LAUNCH_DEPENDENTS: GEMM1 (launched with PDL) may start at once; it
    prefetches weights, then waits for this grid to finish (griddepcontrol.wait) before reading its output."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if DO_ALIGN:
        if pid == 0:
            _align(topk_ids_ptr, sorted_ptr, expert_ids_ptr, cursor_ptr, N, E, MAXB, BM=BM, EP=EP, C=C, CB=CB)
            return
        t = (pid - 1).to(tl.int64)
    else:
        t = pid.to(tl.int64)
    offs = tl.arange(0, HP)
    m = offs < H
    if ZERO_OUT:
        tl.store(out_ptr + t * H + offs, tl.zeros([HP], dtype=tl.float32), mask=m)
    if QUANT > 0:
        x = tl.load(hidden_ptr + t * stride_h + offs, mask=m, other=0.0).to(tl.float32)
        if MXFP8_ACT:
            x = tl.reshape(_mxfp8_round(tl.reshape(x, (1, HP)), 1, HP), (HP,))
        _quant_row(x, xq_ptr + t * H, xlo_ptr + t * H, xscale_ptr + t, offs, m, QUANT)


@triton.jit
def quant_rows_kernel(
    src_ptr,
    q_ptr,
    lo_ptr,
    scale_ptr,
    sorted_ptr,
    N,
    D,
    QUANT: tl.constexpr,
    DP: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """FP8 path, between the GEMMs: row p of act [MAXP, D] (sorted order) -> e4m3 term(s) + 2^m.
    Padding rows (slot id N) are skipped: GEMM2 masks them."""
    p = tl.program_id(0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if tl.load(sorted_ptr + p) >= N:
        return
    offs = tl.arange(0, DP)
    m = offs < D
    x = tl.load(src_ptr + p * D + offs, mask=m, other=0.0).to(tl.float32)
    _quant_row(x, q_ptr + p * D, lo_ptr + p * D, scale_ptr + p, offs, m, QUANT)


@triton.jit
def _dequant_tile(w_ptrs, s_ptrs, sh_ptr, WMODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK] weight tile in the MMA dtype.

    WMODE 0: 16-bit weights as stored (the bf16-weight baseline of the benchmark), no scales.
    WMODE 1: fp16, e4m3 * fp16(2^(s-127)) (all scale bytes in the fp16-exact window; the fast path).
    WMODE 2: fp16, e4m3 * fp16(2^(s-d_e-127)) with the per-expert offset d_e at sh_ptr.
    WMODE 3: bf16, fp32 product e4m3 * 2^(s-127) rounded to bf16 (exact for every byte s >= 1).
    WMODE 7: fp16 of the rebased e4m3 (one scale per row, applied by the caller after the K loop).
    Byte 0 decodes to 0 in every mode.

    Performance rule (Triton 3.6, checked on the SM90 TTGIR): the scale arithmetic may only use
    values loaded as tensors in the loop and constants. Then the whole dequant chain is hoisted
    into the MMA operand layout straight from the shared-memory pipeline buffer; one splat of a
    scalar (e.g. `s - shift` with a scalar shift) breaks that and every tile takes an extra
    registers -> shared -> registers round trip (a tile ~1.6x slower). WMODE 2 therefore loads
    d_e as a broadcast [BN, BK/32] tensor inside the loop (L1 hits)."""
    w = tl.load(w_ptrs)
    if WMODE == 0:  # (an if/elif chain: Triton keeps generating code past a return inside a constexpr if)
        wd = w
    elif WMODE == 7:
        wd = w.to(tl.float16)  # rebased e4m3, its row scale applied after the K loop
    else:
        s = tl.load(s_ptrs).to(tl.int32)  # [BN, BK/32]
        if WMODE == 1:
            sf = (s << 23).to(tl.float32, bitcast=True).to(tl.float16)  # 2^(s-127); byte 0 -> 0
            wd = tl.reshape(w.to(tl.float16), (BN, BK // 32, 32)) * sf[:, :, None]
        elif WMODE == 2:
            sh = tl.load(sh_ptr + tl.zeros([BN, BK // 32], dtype=tl.int32))  # d_e, broadcast
            e = tl.minimum(tl.maximum(s - sh, 0), 254)
            e = tl.where(s == 0, 0, e)  # byte 0 stays 0 after the offset
            sf = (e << 23).to(tl.float32, bitcast=True).to(tl.float16)
            wd = tl.reshape(w.to(tl.float16), (BN, BK // 32, 32)) * sf[:, :, None]
        else:
            sf = (s << 23).to(tl.float32, bitcast=True)  # 2^(s-127)
            wd = (tl.reshape(w.to(tl.float32), (BN, BK // 32, 32)) * sf[:, :, None]).to(tl.bfloat16)
        wd = tl.reshape(wd, (BN, BK))
    return wd


@triton.jit
def _fence_gpu():
    """fence.acq_rel.gpu in every thread (__threadfence())."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of the line at each pointer (a hint: changes no value; callers pass in-bounds lines)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _w13_rows(pid_n, INTER, BN: tl.constexpr):
    """The w13 rows of GEMM1's N tile pid_n: its BN gate rows, then the BN matching up rows [2BN]."""
    r = tl.arange(0, 2 * BN)
    return pid_n * BN + (r % BN) + (r // BN) * INTER


@triton.jit
def _prefetch_slab(
    w_ptr, expert_ids_ptr, E, INTER, NUM_N, stride_we, stride_wn, BN: tl.constexpr, COLS: tl.constexpr
):
    """NOSORT: the first COLS elements (bytes for e4m3) of each row of this program's [gate; up] weight slab
    into L2. Runs before the wait on the prep kernel, which hands over at its start (LAUNCH_DEPENDENTS), so
    the weight stream starts while the input row is still being prepared. The expert id is the router's
    (written before the prep kernel started); it is clamped, so a stale id can only prefetch the wrong lines."""
    pid = tl.program_id(0)
    e = tl.minimum(tl.maximum(tl.load(expert_ids_ptr + pid // NUM_N).to(tl.int64), 0), E - 1)
    wrow = _w13_rows(pid % NUM_N, INTER, BN)  # [2BN]
    cols = tl.arange(0, COLS // 128) * 128  # one pointer per 128-byte line
    _prefetch_l2(w_ptr + e * stride_we + wrow[:, None] * stride_wn + cols[None, :])


@triton.jit
def _block_rows(
    sorted_ptr, expert_ids_ptr, pid_m, N, BM: tl.constexpr, NOSORT: tl.constexpr, TOPK: tl.constexpr
):
    """(expert, rows, slot ids, valid mask, is_active) of BM block pid_m.

    Sorted path: rows pid_m*BM.. of the aligned order, slot ids from sorted_ptr (N on padding).
    NOSORT (T = N / TOPK <= BM tokens, tiny batches, no alignment kernel): expert_ids_ptr is topk_ids
    itself; block m is the routed slot m's expert, and only the first slot of each distinct expert is
    active. Row r is token r: its slot routed to that expert (a token's top-k experts are distinct, as
    top-k selection gives them), masked where it has none, so each slot is computed exactly once, each
    expert's weights are streamed once, and the rows of an expert's block do not grow with top_k. A row's
    act row is its slot id."""
    if NOSORT:
        tok_rows = tl.arange(0, BM)
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int32)
        slot = tl.full([BM], N, dtype=tl.int32)
        for j in tl.static_range(TOPK):  # each token's slot of expert e (N: none)
            s = tok_rows * TOPK + j
            ids = tl.load(expert_ids_ptr + s, mask=s < N, other=-1).to(tl.int32)
            slot = tl.where(ids == e, tl.minimum(slot, s), slot)
        first = tl.min(slot, axis=0)  # the expert's first slot
        return e, slot, slot, slot < N, first == pid_m
    else:
        e = tl.load(expert_ids_ptr + pid_m)
        rows = pid_m * BM + tl.arange(0, BM)
        tok = tl.load(sorted_ptr + rows)  # routed slot ids, N on padding
        return e, rows, tok, tok < N, e >= 0


@triton.jit
def _program_tile(
    sorted_ptr,
    expert_ids_ptr,
    N,
    E,
    NUM_N,
    BM: tl.constexpr,
    NOSORT: tl.constexpr,
    USE_PDL: tl.constexpr,
    TOPK: tl.constexpr,
):
    """(N tile, expert, rows, slot ids, valid mask, has work) of this program; grid order: N tile
    fastest, so neighbouring programs stream adjacent rows of one expert (DRAM locality). No work:
    a block past the last used one (the grid is sized for the worst case: no host sync) or, NOSORT,
    a later slot of an expert an earlier slot's block computes. With USE_PDL (programmatic dependent
    launch) the grid was launched early to hide the launch gap and waits here until the previous
    kernel has finished and its writes are visible."""
    pid = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    e, rows, tok, tmask, active = _block_rows(sorted_ptr, expert_ids_ptr, pid // NUM_N, N, BM, NOSORT, TOPK)
    return pid % NUM_N, e, rows, tok, tmask, active & (e < E)


@triton.jit
def _operand_ptrs(
    a_ptr,
    a_rows,
    stride_a,
    w_ptr,
    s_ptr,
    e64,
    w_rows,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    WMODE: tl.constexpr,
    BK: tl.constexpr,
):
    """Pointers of the first K step: A and W tiles [*, BK]; scale pointers [ROWS, BK/32] (MXFP8 bytes)
    or, for WMODE 4 / 5 / 7 (rebased weights), [ROWS] (one fp32 scale per row and 128 K / per row)."""
    offs_k = tl.arange(0, BK)
    if WMODE >= 4:
        s_ptrs = s_ptr + e64 * stride_se + w_rows * stride_sn
    else:
        s_ptrs = s_ptr + e64 * stride_se + w_rows[:, None] * stride_sn + tl.arange(0, BK // 32)[None, :]
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + e64 * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :]
    return a_ptrs, w_ptrs, s_ptrs


@triton.jit
def _dot_w(w, a, acc, SWAP: tl.constexpr):
    """One MMA of weight tile w [ROWS, BK] and activation tile a [BM, BK]: A W^T [BM, ROWS], or with
    SWAP W A^T [ROWS, BM] (the weights the left operand); added to acc (None: a fresh fp32 accumulator)."""
    if SWAP:  # (an if/else: Triton keeps generating code past a return inside a constexpr if)
        out = tl.dot(w, tl.trans(a), acc)
    else:
        out = tl.dot(a, tl.trans(w), acc)
    return out


@triton.jit
def _mma_loop(
    a_ptrs,
    alo_off,
    amask,
    w_ptrs,
    s_ptrs,
    sh_ptr,
    k_len,
    a_dtype: tl.constexpr,
    WMODE: tl.constexpr,
    TERMS: tl.constexpr,
    SWAP: tl.constexpr,
    ROWS: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """acc [BM, ROWS] fp32 = A W^T over k_len (the K loop of both GEMMs). A rows outside amask read 0.

    WMODE 0..3: the weight tile is dequantized (_dequant_tile) and one 16-bit MMA runs per BK step;
    SWAP makes the weight the MMA's left operand (acc^T = W A^T).
    WMODE 4 (FP8, BK = 128): A is e4m3 (TERMS 2: plus a second e4m3 term, alo_off elements further
    on), W the rebased e4m3 weights with one fp32 power-of-two scale per (row, 128 K); per K step one
    fp8 MMA (two with TERMS 2, chained) whose fp32 result is multiplied by the block scales per weight
    row (exact) and added to the accumulator. A's per-row power-of-two scale is the caller's.
    WMODE 5 (FP8, one scale per weight row): the fp8 MMAs chain into the accumulator over the whole K
    and the row scales multiply it once at the end.
    WMODE 6 (FP8, one scale per weight row, promoted): as WMODE 4 with the row scale at every K step, so
    each 128-wide partial leaves the fp8 MMA's narrower accumulator for fp32 (the serving numerics: its
    MXFP8 rounding of GEMM1's output turns small accumulation errors into whole e4m3 steps).
    WMODE 7 (16-bit MMA on the rebased weights with one scale per row): the e4m3 tile converts to fp16
    (exact) without any scale multiply, the row scales multiply the accumulator once at the end."""
    if WMODE == 4 or WMODE == 5 or WMODE == 6:
        acc = tl.zeros((ROWS, BM) if SWAP else (BM, ROWS), dtype=tl.float32)
        for _ in range(0, k_len, BK):
            w = tl.load(w_ptrs)  # [ROWS, BK] e4m3
            a = tl.load(a_ptrs, mask=amask[:, None], other=0.0)  # [BM, BK] e4m3
            if TERMS == 2:
                a_lo = tl.load(a_ptrs + alo_off, mask=amask[:, None], other=0.0)
            if WMODE == 4 or WMODE == 6:
                part = _dot_w(w, a, None, SWAP)
                if TERMS == 2:
                    part = _dot_w(w, a_lo, part, SWAP)
                s = tl.load(s_ptrs)  # [ROWS] fp32 block scales (WMODE 6: the row scales, every step)
                acc += part * (s[:, None] if SWAP else s[None, :])
                if WMODE == 4:
                    s_ptrs += 1
            else:
                acc = _dot_w(w, a, acc, SWAP)
                if TERMS == 2:
                    acc = _dot_w(w, a_lo, acc, SWAP)
            a_ptrs += BK
            w_ptrs += BK
        if WMODE == 5:
            s = tl.load(s_ptrs)  # [ROWS] fp32 row scales
            acc = acc * (s[:, None] if SWAP else s[None, :])
        if SWAP:
            acc = tl.trans(acc)
    else:
        acc = tl.zeros((ROWS, BM) if SWAP else (BM, ROWS), dtype=tl.float32)
        for _ in range(0, k_len, BK):
            a = tl.load(a_ptrs, mask=amask[:, None], other=0.0).to(a_dtype)  # [BM, BK]
            w = _dequant_tile(w_ptrs, s_ptrs, sh_ptr, WMODE, ROWS, BK)  # [ROWS, BK]
            acc = _dot_w(w, a, acc, SWAP)
            a_ptrs += BK
            w_ptrs += BK
            if WMODE != 7:
                s_ptrs += BK // 32
        if WMODE == 7:
            s = tl.load(s_ptrs)  # [ROWS] fp32 row scales
            acc = acc * (s[:, None] if SWAP else s[None, :])
        if SWAP:
            acc = tl.trans(acc)
    return acc


@triton.jit
def _gemm1_tile(
    x_ptr,
    xlo_off,
    xscale_ptr,
    stride_xm,
    w_ptr,
    s_ptr,
    shift_ptr,
    epi_ptr,
    alpha_ptr,
    beta_ptr,
    limit_ptr,
    bias_ptr,
    bound_ptr,
    act_ptr,
    pid_n,
    e,
    rows,
    tok,
    tmask,
    K,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOPK: tl.constexpr,
    WMODE: tl.constexpr,
    PRESCALED: tl.constexpr,
    TERMS: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    MXFP8_ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT_SCALE: tl.constexpr,
):
    """act[rows, n..n+BN) = SwiGLU-OAI(x W_gate^T, x W_up^T) of one program's tile (see
    gemm1_swiglu_kernel)."""
    e64 = e.to(tl.int64)
    xrow = tok // TOPK
    wrow = _w13_rows(pid_n, INTER, BN)  # [gate rows; up rows] of this tile
    x_ptrs, w_ptrs, s_ptrs = _operand_ptrs(
        x_ptr, xrow, stride_xm, w_ptr, s_ptr, e64, wrow, stride_we, stride_wn, stride_se, stride_sn, WMODE, BK
    )
    if WMODE == 0:
        mma_dtype: tl.constexpr = w_ptr.dtype.element_ty
    elif WMODE == 3:
        mma_dtype: tl.constexpr = tl.bfloat16
    else:
        mma_dtype: tl.constexpr = tl.float16
    acc = _mma_loop(
        x_ptrs,
        xlo_off,
        tmask,
        w_ptrs,
        s_ptrs,
        shift_ptr + e,
        K,
        mma_dtype,
        WMODE,
        TERMS,
        SWAP,
        2 * BN,
        BM,
        BK,
    )  # [BM, 2BN]
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    # undo the operand scales: 2^d_e of the weights (WMODE 2), per-token 2^m of x
    rs = tl.full((BM, 1), 1.0, dtype=tl.float32)
    if WMODE == 2:
        rs = rs * tl.load(epi_ptr + e)
    if PRESCALED:
        xs = tl.load(xscale_ptr + xrow, mask=tmask, other=1.0)  # [BM]
        rs = rs * xs[:, None]  # [BM, 1]
    gate = acc_g * rs
    up = acc_u * rs
    offs_n = pid_n * BN + tl.arange(0, BN)
    if HAS_BIAS:  # [gate; up] bias row of expert e, added before the activation
        b_ptrs = bias_ptr + e.to(tl.int64) * 2 * INTER + offs_n
        gate += tl.load(b_ptrs)[None, :]
        up += tl.load(b_ptrs + INTER)[None, :]
    alpha = tl.load(alpha_ptr + e)
    beta = tl.load(beta_ptr + e)
    limit = tl.load(limit_ptr + e)
    gate = tl.minimum(gate, limit)
    up = tl.maximum(tl.minimum(up, limit), -limit)
    act = gate * tl.sigmoid(alpha * gate) * (up + beta)
    if MXFP8_ACT:  # the serving kernel's FC1 epilogue: bf16, then MXFP8 along I (BN % 32 == 0)
        act = _mxfp8_round(act.to(tl.bfloat16).to(tl.float32), BM, BN)
    if ACT_SCALE:  # into fp16's range by the row's power of two (PRESCALED); GEMM2 multiplies it back
        down, _ = _act_shift(xs, e, bound_ptr, alpha_ptr, beta_ptr, limit_ptr)
        act = act * down[:, None]
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * INTER + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=tmask[:, None])


@triton.jit
def gemm1_swiglu_kernel(
    x_ptr,
    xlo_off,
    xscale_ptr,
    w_ptr,
    s_ptr,
    shift_ptr,
    epi_ptr,
    alpha_ptr,
    beta_ptr,
    limit_ptr,
    sorted_ptr,
    expert_ids_ptr,
    act_ptr,
    N,
    K,
    INTER,
    E,
    NUM_N,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOPK: tl.constexpr,
    WMODE: tl.constexpr,
    PRESCALED: tl.constexpr,
    TERMS: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NOSORT: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    MXFP8_ACT: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0,
    bias_ptr=None,
    bound_ptr=None,
    HAS_BIAS: tl.constexpr = False,
    ACT_SCALE: tl.constexpr = False,
):
    """act[p, n] = SwiGLU-OAI(x W_gate^T, x W_up^T) for sorted row p, columns [n, n+BN) of I.

    One [2BN, K] weight slab per program (BN gate rows then the BN matching up rows), one MMA per K
    step, split in the epilogue. Grid (MAXB * I/BN,). MXFP8_ACT (serving numerics): act is stored as the
    MXFP8 values the serving kernel's GEMM2 reads (bf16 rounding, then _mxfp8_round along I). PREFETCH
    (NOSORT only): elements of each weight row prefetched before the wait on the prep kernel (_prefetch_slab).
    HAS_BIAS: bias_ptr [E, 2I] fp32 is added to the [gate; up] outputs before the activation. ACT_SCALE
    (PRESCALED only): act is stored times the row's power of two from _act_shift (bound_ptr [E, 4])."""
    if PREFETCH > 0:
        _prefetch_slab(w_ptr, expert_ids_ptr, E, INTER, NUM_N, stride_we, stride_wn, BN, PREFETCH)
    pid_n, e, rows, tok, tmask, has_work = _program_tile(
        sorted_ptr, expert_ids_ptr, N, E, NUM_N, BM, NOSORT, USE_PDL, TOPK
    )
    if not has_work:
        return
    _gemm1_tile(
        x_ptr,
        xlo_off,
        xscale_ptr,
        stride_xm,
        w_ptr,
        s_ptr,
        shift_ptr,
        epi_ptr,
        alpha_ptr,
        beta_ptr,
        limit_ptr,
        bias_ptr,
        bound_ptr,
        act_ptr,
        pid_n,
        e,
        rows,
        tok,
        tmask,
        K,
        INTER,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK,
        WMODE,
        PRESCALED,
        TERMS,
        SWAP,
        BM,
        BN,
        BK,
        MXFP8_ACT,
        HAS_BIAS,
        ACT_SCALE,
    )


@triton.jit
def _gemm2_tile(
    act_ptr,
    alo_off,
    ascale_ptr,
    w_ptr,
    s_ptr,
    shift_ptr,
    epi_ptr,
    topk_w_ptr,
    out_ptr,
    pid_n,
    e,
    rows,
    tok,
    tmask,
    K,
    HID,
    rsf,
    NUM_N,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOPK: tl.constexpr,
    WMODE: tl.constexpr,
    TERMS: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    y_ptr,
    count_ptr,
    FUSED_OUT: tl.constexpr,
    bias_ptr,
    bound_ptr,
    alpha_ptr,
    beta_ptr,
    limit_ptr,
    HAS_BIAS: tl.constexpr,
    ACT_SCALE: tl.constexpr,
):
    """One program's tile of gemm2_reduce_kernel: GEMM2, routing weight and the top-k reduce by atomics
    (FUSED_OUT: plus the last arriver's output write, see gemm2_reduce_kernel)."""
    e64 = e.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    a_ptrs, w_ptrs, s_ptrs = _operand_ptrs(
        act_ptr,
        rows.to(tl.int64),
        K,
        w_ptr,
        s_ptr,
        e64,
        offs_n,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        WMODE,
        BK,
    )
    acc = _mma_loop(
        a_ptrs,
        alo_off,
        tmask,
        w_ptrs,
        s_ptrs,
        shift_ptr + e,
        K,
        act_ptr.dtype.element_ty,
        WMODE,
        TERMS,
        SWAP,
        BN,
        BM,
        BK,
    )  # [BM, BN]
    route_w = tl.load(topk_w_ptr + tok, mask=tmask, other=0.0).to(tl.float32) * rsf  # [BM]
    row_scale = route_w
    if WMODE == 2:
        row_scale = row_scale * tl.load(epi_ptr + e)
    if WMODE == 4 or WMODE == 5 or WMODE == 6:
        row_scale = row_scale * tl.load(ascale_ptr + rows, mask=tmask, other=1.0)
    trow = (tok // TOPK).to(tl.int64)
    if ACT_SCALE:  # act was stored times 2^-k (GEMM1's _act_shift of the token's prep scale at ascale_ptr)
        xs = tl.load(ascale_ptr + trow, mask=tmask, other=1.0)
        _, up = _act_shift(xs, e, bound_ptr, alpha_ptr, beta_ptr, limit_ptr)
        row_scale = row_scale * up
    acc = acc * row_scale[:, None]
    if HAS_BIAS:  # expert e's output bias, scaled by the routing weight like the product
        acc += route_w[:, None] * tl.load(bias_ptr + e64 * HID + offs_n)[None, :]
    o_ptrs = out_ptr + trow[:, None] * HID + offs_n[None, :]
    tl.atomic_add(o_ptrs, acc, mask=tmask[:, None], sem="relaxed")
    if FUSED_OUT:
        _fence_gpu()
        tl.debug_barrier()
        c_ptrs = count_ptr + trow * NUM_N + pid_n
        arrived = tl.atomic_add(c_ptrs, 1, mask=tmask, sem="acq_rel")
        last = tmask & (arrived == TOPK - 1)
        tl.debug_barrier()  # the acquiring threads' view is shared before any thread reads rows
        _fence_gpu()
        if tl.max(last.to(tl.int32), axis=0) > 0:
            v = tl.load(o_ptrs, mask=last[:, None], other=0.0, cache_modifier=".cg")
            y_ptrs = y_ptr + trow[:, None] * HID + offs_n[None, :]
            tl.store(y_ptrs, v.to(y_ptr.dtype.element_ty), mask=last[:, None])
            tl.store(o_ptrs, tl.zeros((BM, BN), dtype=tl.float32), mask=last[:, None])
            tl.store(c_ptrs, tl.zeros((BM,), dtype=tl.int32), mask=last)


@triton.jit
def gemm2_reduce_kernel(
    act_ptr,
    alo_off,
    ascale_ptr,
    w_ptr,
    s_ptr,
    shift_ptr,
    epi_ptr,
    topk_w_ptr,
    out_ptr,
    sorted_ptr,
    expert_ids_ptr,
    N,
    K,
    HID,
    E,
    rsf,
    NUM_N,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOPK: tl.constexpr,
    WMODE: tl.constexpr,
    TERMS: tl.constexpr,
    SWAP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    y_ptr=None,
    count_ptr=None,
    NOSORT: tl.constexpr = False,
    FUSED_OUT: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    bias_ptr=None,
    bound_ptr=None,
    alpha_ptr=None,
    beta_ptr=None,
    limit_ptr=None,
    HAS_BIAS: tl.constexpr = False,
    ACT_SCALE: tl.constexpr = False,
):
    """out[token, n] += rsf * w_route * (act W2^T)[p, n] by fp32 atomics: the top-k reduce happens
    in the atomics. Grid (MAXB * H/BN,). SWAP, WMODE, TERMS as in GEMM1; WMODE 4 / 5 read act as e4m3
    term(s) with the per-row scale 2^m at ascale_ptr.

    FUSED_OUT: out is a persistent zeroed fp32 scratch and count_ptr persistent zeroed per
    (token, N tile) arrival counters. After its atomics every thread fences them (fence.acq_rel.gpu),
    a CTA barrier follows, then the counters of its rows are bumped with acq_rel atomics (release:
    this CTA's adds; acquire: all earlier arrivers' adds, each released the same way). The program
    that brings a row's counter to TOPK (the last contribution) crosses a CTA barrier and a fence
    again, reads the finished fp32 row tile from L2 (.cg), stores it to y in y's dtype and re-zeroes
    the scratch tile and the counter for the next call. Calls sharing the scratch must be
    stream-ordered (they are: one stream, one forward at a time).

    HAS_BIAS: bias_ptr [E, H] fp32 times the routing weight (and rsf) joins each row. ACT_SCALE: act rows
    were stored times 2^-k (gemm1_swiglu_kernel); ascale_ptr then holds the tokens' prep scales, and
    _act_shift recomputes the same k from them (bound_ptr, alpha / beta / limit)."""
    pid_n, e, rows, tok, tmask, has_work = _program_tile(
        sorted_ptr, expert_ids_ptr, N, E, NUM_N, BM, NOSORT, USE_PDL, TOPK
    )
    if not has_work:
        return
    _gemm2_tile(
        act_ptr,
        alo_off,
        ascale_ptr,
        w_ptr,
        s_ptr,
        shift_ptr,
        epi_ptr,
        topk_w_ptr,
        out_ptr,
        pid_n,
        e,
        rows,
        tok,
        tmask,
        K,
        HID,
        rsf,
        NUM_N,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK,
        WMODE,
        TERMS,
        SWAP,
        BM,
        BN,
        BK,
        y_ptr,
        count_ptr,
        FUSED_OUT,
        bias_ptr,
        bound_ptr,
        alpha_ptr,
        beta_ptr,
        limit_ptr,
        HAS_BIAS,
        ACT_SCALE,
    )
