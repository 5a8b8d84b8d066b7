"""Triton kernels of the Hopper (SM90, runs on SM80+) MXFP8 fused MoE (issue #5).

Design (../shared/docs/hopper-mxfp8-moe.md §6): weight-only W8A16. Weights are read exactly as stored
(w13 [E, 2I, H] / w2 [E, H, I] float8_e4m3fn, K contiguous, one UE8M0 byte per 32 along K) and
dequantized in registers to fp16, e4m3 * 2^(s-127), with the weight as the RHS of an fp16 MMA
(fp32 accumulate). Launches per forward (see triton_backend.fused_moe):
  * T*k <= 16 (NOSORT): prescale (T programs), GEMM1 (+ SwiGLU-OAI), GEMM2 (+ routing weight,
    top-k reduce by atomics into a persistent zeroed fp32 scratch, bf16 output written by the last
    arriver per (token, N tile)): no alignment, no zeroing, no cast kernel.
  * larger T: prep (align + prescale + zero the fp32 output), GEMM1, GEMM2 (atomics), cast.
  On SM90 the GEMMs are launched with programmatic dependent launch (griddepcontrol.wait first
  thing in the kernel), which hides most of the launch gap between kernels (T=1: 79 -> 69 us).

fp16 range guards (fp16 is exact for every e4m3 * 2^(s-127) only for bytes s in [112, 134]):
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
def _align(topk_ids_ptr, sorted_ptr, expert_ids_ptr, cursor_ptr, N, E, MAXB,
           BM: tl.constexpr, EP: tl.constexpr, C: tl.constexpr, CB: tl.constexpr):
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
def prep_kernel(hidden_ptr, x16_ptr, xscale_ptr, out_ptr, topk_ids_ptr, sorted_ptr, expert_ids_ptr,
                cursor_ptr, T, H, N, E, MAXB, stride_h,
                DO_ALIGN: tl.constexpr, PRESCALE: tl.constexpr, ZERO_OUT: tl.constexpr, HP: tl.constexpr,
                BM: tl.constexpr, EP: tl.constexpr, C: tl.constexpr, CB: tl.constexpr):
    """With DO_ALIGN: program 0 aligns the tokens and programs 1..T handle tokens 0..T-1; without it
    programs 0..T-1 do. Per token: its fp16 copy with its power-of-two pre-scale (PRESCALE) and its
    fp32 output row zeroed for GEMM2's atomics (ZERO_OUT; the fused-output path keeps a persistent
    zeroed scratch instead)."""
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
    if PRESCALE:
        x = tl.load(hidden_ptr + t * stride_h + offs, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        expo = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 amax), normal
        shift = tl.where(amax > 0, expo - 14, 0)
        shift = tl.minimum(tl.maximum(shift, -100), 100)
        down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2^-shift, exact
        up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
        tl.store(x16_ptr + t * H + offs, (x * down).to(tl.float16), mask=m)
        tl.store(xscale_ptr + t, up)


@triton.jit
def _dequant_tile(w_ptrs, s_ptrs, sh_ptr, WMODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK] weight tile in the MMA dtype.

    WMODE 0: 16-bit weights as stored (the bf16-weight baseline of the benchmark), no scales.
    WMODE 1: fp16, e4m3 * fp16(2^(s-127)) (all scale bytes in the fp16-exact window; the fast path).
    WMODE 2: fp16, e4m3 * fp16(2^(s-d_e-127)) with the per-expert offset d_e at sh_ptr.
    WMODE 3: bf16, fp32 product e4m3 * 2^(s-127) rounded to bf16 (exact for every byte s >= 1).
    Byte 0 decodes to 0 in every mode.

    Performance rule (Triton 3.6, checked on the SM90 TTGIR): the scale arithmetic may only use
    values loaded as tensors in the loop and constants. Then the whole dequant chain is hoisted
    into the MMA operand layout straight from the shared-memory pipeline buffer; one splat of a
    scalar (e.g. `s - shift` with a scalar shift) breaks that and every tile takes an extra
    registers -> shared -> registers round trip (measured ~1.6x slower). WMODE 2 therefore loads
    d_e as a broadcast [BN, BK/32] tensor inside the loop (L1 hits)."""
    w = tl.load(w_ptrs)
    if WMODE == 0:
        return w
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
    return tl.reshape(wd, (BN, BK))


@triton.jit
def _tile_ids(NUM_N, SPLIT_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K
    pid_n = (pid // SPLIT_K) % NUM_N
    pid_m = pid // (SPLIT_K * NUM_N)
    return pid_m, pid_n, pid_k


@triton.jit
def _fence_gpu():
    """fence.acq_rel.gpu in every thread (__threadfence())."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _block_rows(sorted_ptr, expert_ids_ptr, pid_m, N, BM: tl.constexpr, NOSORT: tl.constexpr):
    """(expert, rows, slot ids, valid mask, is_active) of BM block pid_m.

    Sorted path: rows pid_m*BM.. of the aligned order, slot ids from sorted_ptr (N on padding).
    NOSORT (N <= BM, tiny batches, no alignment kernel): expert_ids_ptr is topk_ids itself; block m
    is the routed slot m's expert, and only the first slot of each distinct expert is active. Its BM
    rows are all N slots (row = slot id), masked to the slots routed to that expert, so each slot is
    computed exactly once and each expert's weights are streamed once."""
    if NOSORT:
        rows = tl.arange(0, BM)
        ids = tl.load(expert_ids_ptr + rows, mask=rows < N, other=-1).to(tl.int32)
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int32)
        first = tl.min(tl.where(ids == e, rows, BM), axis=0)
        return e, rows, rows, ids == e, first == pid_m
    else:
        e = tl.load(expert_ids_ptr + pid_m)
        rows = pid_m * BM + tl.arange(0, BM)
        tok = tl.load(sorted_ptr + rows)  # routed slot ids, N on padding
        return e, rows, tok, tok < N, e >= 0


@triton.jit
def gemm1_swiglu_kernel(x_ptr, xscale_ptr, w_ptr, s_ptr, shift_ptr, epi_ptr,
                        alpha_ptr, beta_ptr, limit_ptr,
                        sorted_ptr, expert_ids_ptr, act_ptr, part_ptr, count_ptr,
                        N, K, INTER, E, MAXP, NUM_N,
                        stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                        TOPK: tl.constexpr, WMODE: tl.constexpr, PRESCALED: tl.constexpr,
                        FUSED_GU: tl.constexpr, SWAP: tl.constexpr, SPLIT_K: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        NOSORT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """act[p, n] = SwiGLU-OAI(x W_gate^T, x W_up^T) for sorted row p, columns [n, n+BN) of I.

    FUSED_GU: one [2BN, BK] weight tile per step (BN gate rows then the BN matching up rows), one
    MMA, split in the epilogue; else two [BN, BK] tiles and two MMAs per step.
    SWAP: the weight is the MMA's left operand (acc^T = W x^T). On SM90 with BM >= 64 that keeps
    the dequantized tile in registers (wgmma reads A from registers) instead of writing it back to
    shared memory for the B operand (prefill).
    Grid (MAXB * I/BN * SPLIT_K,), split fastest then N tile: neighbouring programs stream adjacent
    rows of one expert (DRAM locality). With SPLIT_K > 1 each program stores an fp32 partial slab;
    the last of the SPLIT_K programs of a tile (per-tile counter, acq_rel) sums them and runs the
    epilogue."""
    pid_m, pid_n, pid_k = _tile_ids(NUM_N, SPLIT_K)
    if USE_PDL:
        # programmatic dependent launch: this grid launched early (hiding the launch gap) and
        # waits here until the previous kernel has finished and its writes are visible
        tl.extra.cuda.gdc_wait()
    e, rows, tok, tmask, active = _block_rows(sorted_ptr, expert_ids_ptr, pid_m, N, BM, NOSORT)
    if e >= E:
        return  # past the last used block (the grid is sized for the worst case: no host sync)
    if not active:
        return  # NOSORT: a later slot of an expert an earlier slot's block computes
    e64 = e.to(tl.int64)
    xrow = tok // TOPK
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_sk = tl.arange(0, BK // 32)
    k_len = K // SPLIT_K
    k0 = tl.multiple_of(pid_k * k_len, BK)  # fit_config: BK * SPLIT_K divides K
    x_ptrs = x_ptr + xrow[:, None] * stride_xm + (k0 + offs_k)[None, :]
    sh_ptr = shift_ptr + e
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    if WMODE == 0:
        mma_dtype: tl.constexpr = w_ptr.dtype.element_ty
    elif WMODE == 3:
        mma_dtype: tl.constexpr = tl.bfloat16
    else:
        mma_dtype: tl.constexpr = tl.float16
    if FUSED_GU:
        r = tl.arange(0, 2 * BN)
        wrow = pid_n * BN + (r % BN) + (r // BN) * INTER  # [gate rows; up rows] of this tile
        w_ptrs = w_ptr + e64 * stride_we + wrow[:, None] * stride_wn + (k0 + offs_k)[None, :]
        s_ptrs = s_ptr + e64 * stride_se + wrow[:, None] * stride_sn + (k0 // 32 + offs_sk)[None, :]
        if SWAP:
            acc_t = tl.zeros((2 * BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        for _ in range(0, k_len, BK):
            x = tl.load(x_ptrs, mask=tmask[:, None], other=0.0).to(mma_dtype)  # [BM, BK]
            w = _dequant_tile(w_ptrs, s_ptrs, sh_ptr, WMODE, 2 * BN, BK)  # [2BN, BK]
            if SWAP:
                acc_t = tl.dot(w, tl.trans(x), acc_t)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BK
            w_ptrs += BK
            s_ptrs += BK // 32
        if SWAP:
            acc = tl.trans(acc_t)
        acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
    else:
        wg_ptrs = w_ptr + e64 * stride_we + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
        wu_ptrs = wg_ptrs + INTER * stride_wn  # up rows follow the I gate rows ([gate; up])
        sg_ptrs = s_ptr + e64 * stride_se + offs_n[:, None] * stride_sn + (k0 // 32 + offs_sk)[None, :]
        su_ptrs = sg_ptrs + INTER * stride_sn
        if SWAP:
            acc_gt = tl.zeros((BN, BM), dtype=tl.float32)
            acc_ut = tl.zeros((BN, BM), dtype=tl.float32)
        for _ in range(0, k_len, BK):
            x = tl.load(x_ptrs, mask=tmask[:, None], other=0.0).to(mma_dtype)  # [BM, BK]
            wg = _dequant_tile(wg_ptrs, sg_ptrs, sh_ptr, WMODE, BN, BK)  # [BN, BK]
            wu = _dequant_tile(wu_ptrs, su_ptrs, sh_ptr, WMODE, BN, BK)
            if SWAP:
                acc_gt = tl.dot(wg, tl.trans(x), acc_gt)
                acc_ut = tl.dot(wu, tl.trans(x), acc_ut)
            else:
                acc_g = tl.dot(x, tl.trans(wg), acc_g)
                acc_u = tl.dot(x, tl.trans(wu), acc_u)
            x_ptrs += BK
            wg_ptrs += BK
            wu_ptrs += BK
            sg_ptrs += BK // 32
            su_ptrs += BK // 32
        if SWAP:
            acc_g = tl.trans(acc_gt)
            acc_u = tl.trans(acc_ut)
    if SPLIT_K > 1:
        two_i = 2 * INTER
        slab = part_ptr + rows[:, None].to(tl.int64) * two_i + offs_n[None, :]  # [SPLIT, MAXP, 2I]
        tl.store(slab + pid_k.to(tl.int64) * MAXP * two_i, acc_g, mask=tmask[:, None])
        tl.store(slab + pid_k.to(tl.int64) * MAXP * two_i + INTER, acc_u, mask=tmask[:, None])
        tl.debug_barrier()  # all partial stores of this program precede its release below
        counter = count_ptr + pid_m * NUM_N + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived != SPLIT_K - 1:
            return
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for j in range(SPLIT_K):
            base = slab + j * MAXP * two_i
            acc_g += tl.load(base, mask=tmask[:, None], other=0.0, cache_modifier=".cg")
            acc_u += tl.load(base + INTER, mask=tmask[:, None], other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)  # leave the counter zeroed for the next call
    _swiglu_store(acc_g, acc_u, e, xrow, tmask, rows, offs_n, xscale_ptr, epi_ptr, alpha_ptr,
                  beta_ptr, limit_ptr, act_ptr, INTER, PRESCALED)


@triton.jit
def _swiglu_store(acc_g, acc_u, e, xrow, tmask, rows, offs_n, xscale_ptr, epi_ptr, alpha_ptr,
                  beta_ptr, limit_ptr, act_ptr, INTER, PRESCALED: tl.constexpr):
    """Undo the fp16 guards (2^d_e, per-token 2^m), SwiGLU-OAI in fp32, store act."""
    scale = tl.load(epi_ptr + e)
    if PRESCALED:
        rs = tl.load(xscale_ptr + xrow, mask=tmask, other=1.0)[:, None] * scale  # [BM, 1]
    else:
        rs = scale
    gate = acc_g * rs
    up = acc_u * rs
    alpha = tl.load(alpha_ptr + e)
    beta = tl.load(beta_ptr + e)
    limit = tl.load(limit_ptr + e)
    gate = tl.minimum(gate, limit)
    up = tl.maximum(tl.minimum(up, limit), -limit)
    act = gate * tl.sigmoid(alpha * gate) * (up + beta)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * INTER + offs_n[None, :]
    tl.store(a_ptrs, act.to(act_ptr.dtype.element_ty), mask=tmask[:, None])


@triton.jit
def gemm2_reduce_kernel(act_ptr, w_ptr, s_ptr, shift_ptr, epi_ptr, topk_w_ptr, out_ptr,
                        sorted_ptr, expert_ids_ptr, N, K, HID, E, rsf, NUM_N,
                        stride_we, stride_wn, stride_se, stride_sn,
                        TOPK: tl.constexpr, WMODE: tl.constexpr, SWAP: tl.constexpr,
                        SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        y_ptr=None, count_ptr=None, NOSORT: tl.constexpr = False,
                        FUSED_OUT: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """out[token, n] += rsf * w_route * (act W2^T)[p, n] by fp32 atomics: the top-k reduce (and the
    split-K reduce when SPLIT_K > 1) happen in the atomics. Grid (MAXB * H/BN * SPLIT_K,).
    SWAP as in GEMM1 (weight as the left MMA operand).

    FUSED_OUT: out is a persistent zeroed fp32 scratch and count_ptr persistent zeroed per
    (token, N tile) arrival counters. After its atomics a program bumps the counters of its rows
    (acq_rel, after a CTA barrier); the program that brings a row's counter to TOPK * SPLIT_K (the
    last contribution) reads the finished fp32 row tile, stores it to y in y's dtype (no separate
    cast kernel, no zeroing kernel) and re-zeroes the scratch tile and the counter for the next call.
    Calls sharing the scratch must be stream-ordered (they are: one stream, one forward at a time)."""
    pid_m, pid_n, pid_k = _tile_ids(NUM_N, SPLIT_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    e, rows, tok, tmask, active = _block_rows(sorted_ptr, expert_ids_ptr, pid_m, N, BM, NOSORT)
    if e >= E:
        return
    if not active:
        return
    e64 = e.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_sk = tl.arange(0, BK // 32)
    k_len = K // SPLIT_K
    k0 = tl.multiple_of(pid_k * k_len, BK)  # fit_config: BK * SPLIT_K divides K
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :]
    w_ptrs = w_ptr + e64 * stride_we + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
    s_ptrs = s_ptr + e64 * stride_se + offs_n[:, None] * stride_sn + (k0 // 32 + offs_sk)[None, :]
    sh_ptr = shift_ptr + e
    if SWAP:
        acc_t = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, k_len, BK):
        a = tl.load(a_ptrs, mask=tmask[:, None], other=0.0)  # [BM, BK] fp16 / bf16
        w = _dequant_tile(w_ptrs, s_ptrs, sh_ptr, WMODE, BN, BK)
        if SWAP:
            acc_t = tl.dot(w, tl.trans(a), acc_t)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BK
        w_ptrs += BK
        s_ptrs += BK // 32
    if SWAP:
        acc = tl.trans(acc_t)
    route_w = tl.load(topk_w_ptr + tok, mask=tmask, other=0.0).to(tl.float32)  # [BM]
    acc = acc * (route_w * (tl.load(epi_ptr + e) * rsf))[:, None]
    trow = (tok // TOPK).to(tl.int64)
    o_ptrs = out_ptr + trow[:, None] * HID + offs_n[None, :]
    tl.atomic_add(o_ptrs, acc, mask=tmask[:, None], sem="relaxed")
    if FUSED_OUT:
        # Each thread fences its own value atomics (gpu scope) before the CTA barrier, so the
        # counter release below covers every thread's contributions. Known issue: on the sorted
        # path at T = 64..256 (MiniMax-M3 dims) the last arriver still sometimes read incomplete
        # rows (rel ~1e-2 vs unfused) with or without these fences; the backend therefore uses
        # FUSED_OUT only on the NOSORT path (<= 16 slots), where it matched to 3e-6.
        _fence_gpu()
        tl.debug_barrier()
        c_ptrs = count_ptr + trow * NUM_N + pid_n
        arrived = tl.atomic_add(c_ptrs, 1, mask=tmask, sem="acq_rel")
        last = tmask & (arrived == TOPK * SPLIT_K - 1)
        tl.debug_barrier()  # the acquiring threads' view is shared before any thread reads rows
        _fence_gpu()
        if tl.max(last.to(tl.int32), axis=0) > 0:
            v = tl.load(o_ptrs, mask=last[:, None], other=0.0, cache_modifier=".cg")
            y_ptrs = y_ptr + trow[:, None] * HID + offs_n[None, :]
            tl.store(y_ptrs, v.to(y_ptr.dtype.element_ty), mask=last[:, None])
            tl.store(o_ptrs, tl.zeros((BM, BN), dtype=tl.float32), mask=last[:, None])
            tl.store(c_ptrs, tl.zeros((BM,), dtype=tl.int32), mask=last)
