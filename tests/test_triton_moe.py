"""Triton MXFP8 fused MoE (runtime/moe/triton/) against the torch reference backend.

GPU tests (marked gpu, skipped without CUDA) draw fresh random weights, routing and activations on
every run (no fixed seed) and poison the CUDA caching allocator with NaN bytes first, so any output
element or intermediate the kernels fail to write shows up as NaN. CPU tests cover the pure-torch
helpers (alignment, fp16 range-guard analysis, config fitting) and the backend's refusals.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch
from interpreter import run_in_interpreter

from porter.format import mxfp8
from runtime.kernels.fused import pdl_supported
from runtime.moe import BackendUnavailable, resolve_backend
from runtime.moe.contract import MoeQuantInfo, MoeRouting, make_swiglu_params
from runtime.moe.torch_backend import TorchMoE
from runtime.moe.triton import TritonMoE
from runtime.moe.triton import config as tc
from runtime.moe.triton import launch as tl
from runtime.moe.triton import prepare as tp

CUDA = torch.cuda.is_available()
REL_TOL = 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_quant(e, h, i, device, weight_scale=0.03, swiglu=None, row_gain=None, biases=False):
    """Random MXFP8 expert weights (quantized with porter.format.mxfp8) and per-expert SwiGLU params;
    biases: gpt-oss-like fp32 expert biases (w13_bias [E, 2I] ~ N(0, 0.5), w2_bias [E, H] ~ N(0, 0.05))."""
    w13 = torch.randn(e, 2 * i, h, device=device) * weight_scale  # [E, 2I, H]
    w2 = torch.randn(e, h, i, device=device) * weight_scale  # [E, H, I]
    if row_gain is not None:  # [E, 2I, 1] per-row power-of-two gains (scale-byte spread)
        w13 = w13 * row_gain
    q13, s13 = mxfp8.quantize(w13)
    q2, s2 = mxfp8.quantize(w2)
    if swiglu is None:  # non-default and different per expert
        swiglu = {
            "gemm1_alpha": torch.empty(e, device=device).uniform_(1.0, 2.5),
            "gemm1_beta": torch.empty(e, device=device).uniform_(0.0, 1.5),
            "gemm1_clamp_limit": torch.empty(e, device=device).uniform_(3.0, 9.0),
        }
    bias = {}
    if biases:
        bias = {
            "w13_bias": torch.randn(e, 2 * i, device=device) * 0.5,
            "w2_bias": torch.randn(e, h, device=device) * 0.05,
        }
    return MoeQuantInfo(q13, s13, q2, s2, **swiglu, **bias)


def prepared(q: MoeQuantInfo, **options):
    """runtime.moe.triton.prepare on a MoeQuantInfo's tensors, in its field order."""
    return tp.prepare(*(getattr(q, f.name) for f in fields(q)), **options)


def skewed_routing(t, e, k, device, empty_experts=2):
    """Uneven routing: Zipf-like expert popularity; the last `empty_experts` experts get no token."""
    pop = 1.0 / torch.arange(1, e + 1, device=device, dtype=torch.float32) ** 1.2
    pop[e - empty_experts :] = 0
    pop = pop[torch.randperm(e, device=device)]  # popular experts anywhere in the id range
    ids = torch.multinomial(pop.expand(t, e), k, replacement=False)  # [T, k] distinct per token
    w = torch.rand(t, k, device=device) + 0.05
    return ids, w / w.sum(-1, keepdim=True)


def poison_allocator(nbytes=1 << 28):
    """Fill cached CUDA memory with 0xFF (NaN in fp32/fp16/bf16) so unwritten outputs read NaN."""
    torch.cuda.empty_cache()
    blocks = [torch.full((nbytes // 8,), -1, dtype=torch.int64, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    del blocks


def check_against_torch(
    quant,
    t,
    k,
    h,
    rsf=2.5,
    config=None,
    x_scale=1.0,
    tol=REL_TOL,
    errs=None,
    key=None,
    rebase=True,
    fp8_row_scale=tc.FP8_ROW_SCALE,
):
    e = quant.num_experts
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, rsf)
    x = (torch.randn(t, h, device="cuda") * x_scale).to(torch.bfloat16)
    ids, w = skewed_routing(t, e, k, "cuda")
    assert torch.bincount(ids.flatten(), minlength=e).eq(0).any()  # some experts get no token
    ref = TorchMoE(quant, routing).forward_topk(x, ids, w)
    moe = TritonMoE(quant, routing, rebase=rebase)
    poison_allocator()
    out = tl.fused_moe(moe.prepared, x, ids, w, rsf, config, fp8_row_scale=fp8_row_scale)
    torch.cuda.synchronize()
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or overflowed output elements"
    err = rel(out, ref)
    if errs is not None:
        errs[key] = err
    assert err <= tol, f"T={t} {config}: rel error {err:.3e} > {tol}"
    return moe, x, ids, w, out


def assert_fused_out_scratch_zero(device, h):
    """The fused output's persistent fp32 scratch and arrival counters are zero again (its last arrivers
    re-zero them for the next call)."""
    scratch, counts = tl._fused_out_scratch(device, h)
    assert scratch.eq(0).all() and counts.eq(0).all()


# ---------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 3, 16, 64, 257, 4096])
def test_matches_torch_small_dims(t):
    quant = make_quant(16, 256, 128, "cuda")
    check_against_torch(quant, t, 4, 256)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 4, 64, 1024])
@pytest.mark.parametrize("rebase", [True, False])
def test_matches_torch_minimax_like_dims(t, rebase):
    # H, I multiples of every tile (BK 256, BN 128) like MiniMax-M3's 6144 / 3072, 32 experts; the
    # experts rebased at load (default) and as stored (WMODE 1)
    quant = make_quant(32, 1536, 768, "cuda")
    moe, *_ = check_against_torch(quant, t, 4, 1536, rebase=rebase)
    assert moe.prepared.rebased == rebase and moe.prepared.wmode1 == (7 if rebase else 1)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 2, 4])
def test_repeat_calls_agree_within_one_bf16_ulp(t):
    """The NOSORT path, with the fused output at one token (last arriver per (token, N tile) writes
    y, re-zeroes scratch and counters) and prep zeroing + atomics + cast at 2 and 4 tokens: a second
    and third call on the same inputs reuse the counters and scratch the first left zeroed. Only the order of
    the fp32 top-k atomics may differ between calls, so every element
    agrees to within one bf16 rounding step of its magnitude (2^-8 relative); a missed contribution
    or a stale counter is orders of magnitude larger."""
    quant = make_quant(8, 768, 384, "cuda")
    moe, x, ids, w, out = check_against_torch(quant, t, 4, 768)
    for _ in range(2):
        again = moe.forward_topk(x, ids, w)
        torch.cuda.synchronize()
        step = out.float().abs() * 2.0**-8 + 1e-30
        assert ((again.float() - out.float()).abs() <= step).all(), (
            f"max diff {(again - out).abs().max():.3e}"
        )
    assert_fused_out_scratch_zero(x.device, 768)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize(
    "t,cfg",
    [
        (300, tc.MoeConfig(64, 64, 64, 4, 3, 128, 64, 4, 3, True, True)),  # weight as LHS
        (300, tc.MoeConfig(128, 64, 128, 8, 3, 128, 128, 8, 3, True, True)),
        (40, tc.MoeConfig(32, 32, 256, 4, 4, 64, 256, 4, 4)),
    ],
)
def test_tile_variants(t, cfg):
    quant = make_quant(16, 768, 384, "cuda")
    check_against_torch(quant, t, 4, 768, config=cfg)


FP8_CFG = tc.MoeConfig(64, 64, 128, 4, 3, 128, 128, 4, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 MMA (SM89+)")
@pytest.mark.parametrize("t", [100, 300, 1100])
@pytest.mark.parametrize("row_scale", [False, True])
def test_fp8_prefill_matches_torch(t, row_scale):
    """FP8 path (e4m3 activations per token with a power-of-two scale, the e4m3 weights rebased to one
    power-of-two scale per (row, 128 K) applied to each K step's partial, or with row_scale one per row
    applied once at the end). Bounds against the torch reference: two e4m3 terms <= 2e-2 (bf16 act and
    output rounding remain); one term <= 6e-2 (e4m3's 4 significant bits on both GEMMs' activations:
    4.3e-2 in a CPU simulation). T=100 aligns in the prep kernel, T=300 and 1100 in torch (more than
    1024 routed slots)."""
    quant = make_quant(16, 1536, 768, "cuda", swiglu=make_swiglu_params(16, 1.702, 1.0, 7.0, "cuda"))
    errs = {}
    for terms, bound in ((2, 2e-2), (1, 6e-2)):
        check_against_torch(
            quant,
            t,
            4,
            1536,
            config=replace(FP8_CFG, fp8=terms),
            tol=bound,
            errs=errs,
            key=terms,
            rebase=False,
            fp8_row_scale=row_scale,
        )  # the copy made for the FP8 path
    assert errs[2] < errs[1] / 4, f"the second e4m3 term should cut the error: {errs}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 4, 16, 300, 600, 1100])
def test_load_time_rebase_replaces_the_stored_weights(t):
    """rebase=True (the default): where row_scale_ok holds, prepare rebases the experts to one power-of-two
    scale per row and keeps only that copy - every path reads it (W8A16 as WMODE 7 below
    FP8_PREFILL_MIN_TOKENS, the FP8 path at 600 and 1100 without a second copy) and the backend drops its
    reference to the MXFP8 tensors. At MiniMax-M3's H 6144 / I 3072: within the bounds of the torch
    reference (W8A16 1e-2, FP8 2e-2) and of the layer on the weights as stored (the rebase moves values by
    <= 1e-5 relative; W8A16 within 1e-3, the rest is fp32 summation order and bf16 output rounding)."""
    e, h, i, k = 8, 6144, 3072, 4
    quant = make_quant(e, h, i, "cuda", swiglu=make_swiglu_params(e, 1.702, 1.0, 7.0, "cuda"))
    fp8 = t >= tc.FP8_PREFILL_MIN_TOKENS
    stored_moe, x, ids, w, stored = check_against_torch(
        quant, t, k, h, tol=2e-2 if fp8 else REL_TOL, rebase=False
    )
    assert not stored_moe.prepared.rebased and stored_moe.quant is quant
    del stored_moe
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moe = TritonMoE(
        quant, MoeRouting(torch.zeros(e, h, device="cuda"), torch.zeros(e, device="cuda"), k, 2.5)
    )
    p = moe.prepared
    assert p.rebased and moe.replaced_weights and moe.quant is None
    assert (
        (p.wmode1, p.wmode2) == (7, 7)
        and p.w13_scale.shape == (e, 2 * i, 1)
        and p.w2_scale.shape == (e, h, 1)
    )
    expert_bytes = sum(t_.numel() * t_.element_size() for t_ in (p.w13, p.w13_scale, p.w2, p.w2_scale))
    assert torch.cuda.memory_allocated() - before <= expert_bytes * 1.01  # one rebased copy, nothing else
    rebased = moe.forward_topk(x, ids, w)
    torch.cuda.synchronize()
    assert (
        p.fp8_blocks is None
    )  # the FP8 path (t >= FP8_PREFILL_MIN_TOKENS) read the rebased weights themselves
    ref = TorchMoE(quant, moe.routing).forward_topk(x, ids, w)
    assert rel(rebased, ref) <= (2e-2 if fp8 else REL_TOL)
    if not fp8:
        assert rel(rebased, stored) <= 1e-3, f"{rel(rebased, stored):.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9), reason="needs fp8 MMA (SM89+)")
@pytest.mark.parametrize("terms", [1, 2])
def test_fp8_activation_quantization_is_rne_with_pow2_scale(terms):
    """prep's e4m3 quantization: m = floor(log2 amax) - 7 per token, hi = rne_e4m3(x 2^-m), lo =
    rne_e4m3(x 2^-m - hi); bit-equal to torch's casts for rows from 2^-30 to 2^30 in magnitude."""
    from runtime.moe.triton import kernels as K

    t, h = 64, 6144
    x = torch.randn(t, h, device="cuda") * torch.exp2(torch.linspace(-30, 30, t, device="cuda"))[:, None]
    x = x.to(torch.bfloat16)
    xq = torch.empty((terms, t, h), dtype=torch.float8_e4m3fn, device="cuda")
    xscale = torch.empty(t, device="cuda")
    dummy = torch.empty(1, dtype=torch.int32, device="cuda")
    K.prep_kernel[(t,)](
        x,
        xq,
        xq[-1],
        xscale,
        dummy,
        dummy,
        dummy,
        dummy,
        dummy,
        t,
        h,
        1,
        1,
        1,
        x.stride(0),
        DO_ALIGN=False,
        QUANT=1 + terms,
        ZERO_OUT=False,
        HP=8192,
        BM=16,
        EP=2,
        C=64,
        CB=128,
        num_warps=8,
    )
    xf = x.float()
    m = torch.frexp(xf.abs().amax(1))[1] - 1 - 7  # floor(log2 amax) - 7
    assert torch.equal(xscale, torch.exp2(m.float()))
    xs = xf * torch.exp2(-m.float())[:, None]
    hi = xs.to(torch.float8_e4m3fn)
    assert torch.equal(xq[0].view(torch.uint8), hi.view(torch.uint8))
    if terms == 2:
        lo = (xs - hi.float()).to(torch.float8_e4m3fn)
        assert torch.equal(xq[1].view(torch.uint8), lo.view(torch.uint8))
        assert rel(hi.float() + lo.float(), xs) < 2e-3  # bf16 input: ~8 significant bits kept


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize(
    "t,k,e", [(1, 4, 16), (2, 4, 6), (4, 4, 8), (3, 4, 128), (16, 1, 8), (4, 8, 32), (8, 8, 256), (8, 8, 12)]
)
def test_nosort_path_matches_torch(t, k, e):
    """Tiny batches (T <= NOSORT_MAX_TOKENS by default; explicitly up to 16 here): no alignment kernel, one
    block per routed slot whose rows are the tokens, so top-8 (T * k up to 64 slots) keeps BM 16; duplicate
    experts (e=6, 8, 12: slots of different tokens share experts) computed once by the first slot's block."""
    quant = make_quant(e, 768, 384, "cuda")
    routing = MoeRouting(torch.randn(e, 768, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, 2.5)
    x = torch.randn(t, 768, device="cuda").to(torch.bfloat16)
    ids, w = skewed_routing(t, e, k, "cuda", empty_experts=1)
    ref = TorchMoE(quant, routing).forward_topk(x, ids, w)
    moe = TritonMoE(quant, routing)
    for nosort in (True, False):
        poison_allocator()
        out = tl.fused_moe(moe.prepared, x, ids, w, 2.5, nosort=nosort)
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert rel(out, ref) <= REL_TOL, f"nosort={nosort}: {rel(out, ref):.3e}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or not pdl_supported(torch.device("cuda")), reason="needs PDL (SM90+)")
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("mxfp8_act", [False, True])
def test_nosort_weight_prefetch_changes_no_value(t, mxfp8_act):
    """GEMM1 prefetches its first weight lines before waiting on the prep kernel (which hands over at its
    start): a hint, so the output is bit-identical to the launch without it, eager and captured, at
    MiniMax-M3's dims; every extent rounds to whole lines within H."""
    extents = {(512, 6144): 512, (512, 256): 256, (512, 96): 0, (0, 6144): 0}  # (asked, H): lines kept
    assert {c: tl._prefetch_cols(*c) for c in extents} == extents
    quant = make_quant(8, 6144, 3072, "cuda", weight_scale=0.02)
    x = torch.randn(t, 6144, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, device="cuda")[:4] for _ in range(t)])
    w = torch.full((t, 4), 0.25, device="cuda")
    p = prepared(quant)
    run = lambda pf: tl.fused_moe(p, x, ids, w, 2.5, mxfp8_act=mxfp8_act, weight_prefetch=pf)
    want = run(False)
    assert torch.equal(run(True), want)
    graph = torch.cuda.CUDAGraph()
    run(True)  # compiled before capture
    with torch.cuda.graph(graph):
        out = run(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize(
    "t,cfg",
    [
        (1, None),
        (8, None),
        (3, tc.MoeConfig(16, 32, 128, 4, 3, 64, 128, 4, 3)),
        (40, None),
        (300, tc.MoeConfig(64, 64, 64, 4, 3, 128, 64, 4, 3)),
    ],
)
def test_fused_output_paths_agree_and_leave_scratch_zeroed(t, cfg):
    """Every path (no-sort with the fused last-arriver output at one token, no-sort unfused incl.
    forced at T*k = 32, sorted prep + atomics + cast) gives the same result;
    the persistent fp32 scratch and arrival counters are zero again after each call. (The fused
    output is not requested for several tokens: docs/known-issues.md.)"""
    e, h, i, k = 16, 768, 384, 4
    quant = make_quant(e, h, i, "cuda")
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, 2.5)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    ids, w = skewed_routing(t, e, k, "cuda")
    ref = TorchMoE(quant, routing).forward_topk(x, ids, w)
    p = TritonMoE(quant, routing).prepared
    base = tl.fused_moe(p, x, ids, w, 2.5, cfg, nosort=False, fused_out=False)
    assert rel(base, ref) <= REL_TOL
    variants = [(True, False)] if t * k <= 64 else [(False, True)]  # (False, True): unfused (sorted)
    if t == 1:
        variants.append((True, True))
    for nosort, fused in variants:
        for _ in range(2):  # the second call reuses the scratch the first left zeroed
            poison_allocator()
            out = tl.fused_moe(p, x, ids, w, 2.5, cfg, nosort=nosort, fused_out=fused)
            torch.cuda.synchronize()
            assert torch.isfinite(out).all()
            assert rel(out, base) < 4e-3, f"nosort={nosort} fused={fused}: {rel(out, base):.2e}"
            if fused:
                assert_fused_out_scratch_zero(x.device, h)


def _race_problem(t: int):
    """MiniMax-like race-test problem on CUDA (1536 x 768, 32 experts, top-4, rsf 2.5): prepared weights,
    x [t, h] bf16, topk ids and weights [t, 4]."""
    e, h, i, k = 32, 1536, 768, 4
    quant = make_quant(e, h, i, "cuda")
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, 2.5)
    p = TritonMoE(quant, routing).prepared
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
    w = torch.rand(t, k, device="cuda") + 0.1
    return p, x, ids, w


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1])
def test_fused_output_last_arriver_is_race_free(t):
    """The fused output's last arriver must see every other program's atomics. fused_out=True is
    honoured on the NOSORT path only (the sorted-path variant raced at MiniMax-M3 dims, T >= 64:
    rel ~1e-2 vs unfused; a T = 200 case here compared the unfused path with itself and was dropped).
    Several tokens on the NOSORT path raced too (T = 4) and no longer take the fused output by default
    (test_fused_output_many_calls_at_real_dims)."""
    p, x, ids, w = _race_problem(t)
    base = tl.fused_moe(p, x, ids, w, 2.5, nosort=False, fused_out=False)
    worst = max(rel(tl.fused_moe(p, x, ids, w, 2.5, fused_out=True), base) for _ in range(12))
    assert worst < 1e-3, f"fused output differs from the unfused path: {worst:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 4])
def test_fused_output_many_calls_at_real_dims(t):
    """200 calls in a row at MiniMax-M3's layer dims (H 6144, I 3072; 8 experts, so T=4 shares experts
    between tokens), each checked against the sorted unfused path: a last arriver that reads before
    another program's adds land, or an add that lands after the re-zeroing, shows up as a wrong call
    (~1e-2) and as a nonzero scratch after the last call; fp32 add order alone stays below 1e-5.
    T=1 runs the fused output; T=4 runs the unfused NOSORT path since the fused output there had 8 of
    200 calls off by up to 5e-2 on the H200."""
    e, h, i, k = 8, 6144, 3072, 4
    quant = make_quant(e, h, i, "cuda", swiglu=make_swiglu_params(e, 1.702, 1.0, 7.0, "cuda"))
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, 2.5)
    p = TritonMoE(quant, routing).prepared
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    ids = torch.rand(t, e, device="cuda").topk(k, dim=-1).indices
    w = torch.rand(t, k, device="cuda") + 0.1
    base = tl.fused_moe(p, x, ids, w, 2.5, nosort=False, fused_out=False).float()
    errs = torch.stack(
        [(tl.fused_moe(p, x, ids, w, 2.5).float() - base).norm() / base.norm() for _ in range(200)]
    )  # on the device: no sync per call
    worst = float(errs.max())
    assert worst < 1e-3, f"{int((errs > 1e-3).sum())} of 200 calls off, worst {worst:.2e}"
    assert_fused_out_scratch_zero(x.device, h)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 7, 200])
def test_in_kernel_alignment_equals_torch_alignment(t):
    e, k = 24, 4
    ids, _ = skewed_routing(t, e, k, "cuda", empty_experts=5)
    for bm in (16, 32, 64):
        s_ref, e_ref = tl.align_tokens(ids, e, bm)
        poison_allocator()
        s_k, e_k = tl.align_tokens_triton(ids, e, bm)
        assert torch.equal(s_k, s_ref) and torch.equal(e_k, e_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("octaves", [-16, 24])
def test_weight_scale_bytes_outside_fp16_window_are_offset(octaves):
    # bytes (about 114 at sigma 0.03) moved to about 98 / 138, outside [112, 134]; the spread stays
    # small, so an exact per-expert offset exists and the fp16 path is kept (weights as stored)
    quant = make_quant(8, 512, 256, "cuda", weight_scale=0.03 * 2.0**octaves)
    moe, *_ = check_against_torch(quant, 16, 4, 512, rebase=False)
    assert moe.prepared.fp16_1 and moe.prepared.fp16_2
    assert int(moe.prepared.shift13.abs().max()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("rebase", [False, True])
def test_wide_scale_spread_falls_back_to_bf16(rebase):
    """A 24-octave spread between the rows of every expert: as stored no fp16-exact per-expert offset
    exists and GEMM1 runs in bf16 (WMODE 3); rebased at load each row has its own fp32 scale, so the
    fp16 path (WMODE 7) holds it exactly."""
    e, h, i = 8, 512, 256
    gain = torch.ones(e, 2 * i, 1, device="cuda")
    gain[:, ::2] = 2.0**24  # 24-octave spread inside every expert: no fp16-exact offset exists
    quant = make_quant(e, h, i, "cuda", weight_scale=0.03 * 2.0**-12, row_gain=gain)
    moe, *_ = check_against_torch(quant, 16, 4, h, rebase=rebase)
    assert moe.prepared.rebased == rebase and moe.prepared.fp16_1 == rebase


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("x_scale", [3e5, 1e-4])
def test_activations_outside_fp16_range(x_scale):
    # 3e5 overflows fp16 (max 65504) unless pre-scaled; at 1e-4 many inputs are fp16-subnormal unless pre-scaled
    quant = make_quant(8, 512, 256, "cuda", swiglu=make_swiglu_params(8, 1.702, 1.0, 7.0, "cuda"))
    moe, *_ = check_against_torch(quant, 16, 4, 512, x_scale=x_scale)
    assert moe.prepared.fp16_1 and moe.prepared.fp16_2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("limit,x_scale", [(math.inf, 30.0), (1e4, 1e-4), (1e4, 300.0), (math.inf, 3e3)])
@pytest.mark.parametrize("rebase", [True, False])
def test_large_swiglu_bound_scales_act_per_row(limit, x_scale, rebase):
    """A SwiGLU-OAI bound past fp16 (limit 1e4 or inf): act is stored in fp16 times each row's power of two
    (prepare.act_bounds, kernels._act_shift) and GEMM2 stays an fp16 GEMM; at x * 3e3 plain act reaches
    ~1e6, far past fp16's 65504, so an unscaled fp16 act would overflow to inf."""
    quant = make_quant(8, 512, 256, "cuda", swiglu=make_swiglu_params(8, 1.702, 1.0, limit, "cuda"))
    moe, *_ = check_against_torch(quant, 16, 4, 512, x_scale=x_scale, rebase=rebase)
    p = moe.prepared
    assert p.rebased == rebase and p.fp16_1 and p.fp16_2 and p.act_bound is not None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
def test_large_swiglu_bound_with_gemm1_in_bf16_runs_gemm2_in_bf16():
    """Weights kept as stored with a 24-octave spread run GEMM1 in bf16 (no prescaled fp16 tokens): act is
    then stored in bf16 unscaled and GEMM2 runs in bf16, as before the per-row scaling."""
    e, h, i = 8, 512, 256
    gain = torch.ones(e, 2 * i, 1, device="cuda")
    gain[:, ::2] = 2.0**24
    quant = make_quant(
        e,
        h,
        i,
        "cuda",
        weight_scale=0.03 * 2.0**-12,
        row_gain=gain,
        swiglu=make_swiglu_params(e, 1.0, 0.0, math.inf, "cuda"),
    )
    moe, *_ = check_against_torch(quant, 16, 4, h, rebase=False)
    p = moe.prepared
    assert not p.fp16_1 and not p.fp16_2 and p.act_bound is None


M2_DIMS = (256, 3072, 1536, 8)  # MiniMax-M2's routed layer: E, H, I, top-k (plain SwiGLU)


@pytest.fixture(scope="module")
def m2_quant():
    if not CUDA:
        pytest.skip("needs a CUDA GPU (SM80+)")
    e, h, i, _ = M2_DIMS
    return make_quant(
        e, h, i, "cuda", weight_scale=0.02, swiglu=make_swiglu_params(e, 1.0, 0.0, math.inf, "cuda")
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize(
    "t,x_scale,rebase",
    [(t, 1.0, True) for t in (1, 2, 4, 8, 16, 64)]
    + [(1, 300.0, True), (4, 300.0, True), (1, 300.0, False), (4, 1.0, False), (16, 1.0, False)],
)
def test_m2_dims_plain_swiglu_matches_torch(m2_quant, t, x_scale, rebase):
    """MiniMax-M2's layer at its real dims (E 256, H 3072, I 1536, top-8) with plain SwiGLU as alpha 1 / beta 0
    / limit inf, on the default path for each T (NOSORT and sorted), rebased at load and as stored; x * 300
    drives act far past fp16 (act scaled per row)."""
    e, h, _, k = M2_DIMS
    moe, *_ = check_against_torch(m2_quant, t, k, h, rsf=1.0, x_scale=x_scale, rebase=rebase)
    assert moe.prepared.act_bound is not None and moe.prepared.fp16_2


GPT_OSS_DIMS = (32, 2880, 2880, 4)  # gpt-oss-20b's routed layer: E, H, I, top-k


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 4, 64, 600])
@pytest.mark.parametrize("swiglu", [(1.702, 1.0, 7.0), (1.0, 0.0, math.inf)])
def test_expert_biases_match_torch_at_gpt_oss_dims(t, swiglu):
    """Per-expert biases (w13_bias before the activation, w2_bias before the routing weight) at gpt-oss-20b's
    layer dims (E 32, H 2880, I 2880, top-4; K = 2880 is not a multiple of 128, so GEMM1 / GEMM2 step K by 64
    and prefill stays on W8A16), gpt-oss's SwiGLU-OAI and plain SwiGLU (act scaled per row, the bias in its
    bound): Triton within 1e-2 of the torch reference, and the biases move the output far more than that."""
    e, h, i, k = GPT_OSS_DIMS
    quant = make_quant(
        e, h, i, "cuda", weight_scale=0.02, swiglu=make_swiglu_params(e, *swiglu, "cuda"), biases=True
    )
    moe, x, ids, w, out = check_against_torch(quant, t, k, h, rsf=1.0)
    without = replace(quant, w13_bias=None, w2_bias=None)
    plain = tl.fused_moe(TritonMoE(without, moe.routing).prepared, x, ids, w, 1.0)
    assert rel(plain, out) > 10 * REL_TOL  # the biases are really added


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 4, 64])
def test_expert_biases_in_serving_numerics(t):
    """numerics="serving" with biases: the bias joins GEMM1's output before the SwiGLU and its MXFP8 rounding,
    in Triton and in the torch reference alike (within 5e-3, as the serving test without biases)."""
    e, h, i, k = 16, 1536, 768, 4
    quant = make_quant(e, h, i, "cuda", swiglu=make_swiglu_params(e, 1.702, 1.0, 7.0, "cuda"), biases=True)
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, 1.0)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    ids, w = skewed_routing(t, e, k, "cuda")
    ref = TorchMoE(quant, routing, numerics="serving").forward_topk(x, ids, w)
    poison_allocator()
    out = TritonMoE(quant, routing, numerics="serving").forward_topk(x, ids, w)
    assert torch.isfinite(out).all() and rel(out, ref) <= 5e-3


def decode_tile_variants(t):
    """default_config's decode tiles and the two-warp variants with the weights as the mma.sync left
    operand that the H200 decode A/B measured (slower; benchmarks/results/moe_decode_timing_round5_call3.log)."""
    d = tc.default_config(t)
    return [
        d,
        replace(d, bn1=32, warps1=2, swap1=True, bn2=64, warps2=2, swap2=True),
        replace(d, bn1=16, warps1=2, swap1=True, bn2=32, warps2=2, swap2=True),
    ]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 4, 16, 64])
def test_decode_tiles_match_torch_at_real_dims(t):
    """Decode tiles (decode_tile_variants, and the wgmma variant with the weights as left operand at
    4 warps) at MiniMax-M3's layer dims (H 6144, I 3072; 16 experts, top-4) against the torch reference."""
    e, h, i, k = 16, 6144, 3072, 4
    quant = make_quant(e, h, i, "cuda", swiglu=make_swiglu_params(e, 1.702, 1.0, 7.0, "cuda"))
    errs = {}
    cfgs = decode_tile_variants(t) + [replace(tc.default_config(t), swap1=True, swap2=True)]
    for j, cfg in enumerate(cfgs):
        check_against_torch(quant, t, k, h, config=cfg, errs=errs, key=j)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
def test_call_routes_and_applies_rsf_once():
    e, h, i, k = 16, 256, 128, 4
    quant = make_quant(e, h, i, "cuda")
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.randn(e, device="cuda") * 0.1, k, 2.5)
    x = torch.randn(33, h, device="cuda").to(torch.bfloat16)
    ref = TorchMoE(quant, routing)(x)
    poison_allocator()
    out = TritonMoE(quant, routing)(x)
    assert rel(out, ref) <= REL_TOL
    assert resolve_backend("triton", torch.device("cuda")) == "triton"


# ---------------------------------------------------------------------------------------- CPU


def test_check_supported_refuses_cpu_naming_capability():
    with pytest.raises(BackendUnavailable, match="capability"):
        TritonMoE.check_supported(torch.device("cpu"))
    with pytest.raises(BackendUnavailable, match="capability"):
        resolve_backend("triton", torch.device("cpu"))


def test_rejects_unquantized_weights():
    e, h, i = 4, 64, 32
    quant = MoeQuantInfo(
        torch.randn(e, 2 * i, h),
        None,
        torch.randn(e, h, i),
        None,
        **make_swiglu_params(e, 1.702, 1.0, 7.0, "cpu"),
    )
    routing = MoeRouting(torch.randn(e, h), torch.zeros(e), 2, 1.0)
    with pytest.raises(BackendUnavailable, match="MXFP8"):  # bad input: exit 2, not an internal error
        TritonMoE(quant, routing)


@pytest.mark.parametrize("t,e,k,bm", [(1, 8, 2, 16), (37, 16, 4, 16), (300, 128, 4, 64), (5, 3, 3, 32)])
def test_align_tokens_invariants(t, e, k, bm):
    ids, _ = skewed_routing(t, e, k, "cpu", empty_experts=min(2, e - k))
    sorted_ids, expert_ids = tl.align_tokens(ids, e, bm)
    n = t * k
    assert sorted_ids.numel() == expert_ids.numel() * bm == tc.max_blocks(n, e, bm) * bm
    flat = ids.flatten()
    valid = sorted_ids[sorted_ids < n].long()
    assert torch.equal(torch.sort(valid).values, torch.arange(n))  # every slot exactly once
    blocks = sorted_ids.view(-1, bm)
    for b in range(blocks.shape[0]):
        slots = blocks[b][blocks[b] < n].long()
        if expert_ids[b] == e:  # unused tail block
            assert slots.numel() == 0
            continue
        assert (flat[slots] == expert_ids[b]).all()  # one expert per block
        assert torch.equal(slots, torch.sort(slots).values)  # stable within the expert
    used = expert_ids[expert_ids < e]
    assert torch.equal(used, torch.sort(used).values)
    assert set(used.tolist()) == set(flat.tolist())  # experts without tokens get no block


@pytest.mark.slow
def test_kernels_in_the_triton_interpreter_match_torch():
    """The kernels in Triton's CPU interpreter (tests/moe_interpreter_cases.py, a child process: the
    interpreter is chosen when the kernels are imported) at tiny dims: MiniMax-M2's top-8 plain SwiGLU
    (NOSORT and sorted, rebased and stored, activations past fp16 that only the per-row act scaling keeps
    finite) and gpt-oss's SwiGLU-OAI with expert biases. Each within 4e-3 of the torch reference (the bf16
    output's rounding is ~1.7e-3)."""
    pytest.importorskip("triton")
    rows = run_in_interpreter("moe_interpreter_cases.py")
    assert len(rows) == 11
    for r in rows:
        assert r["finite"] and r["rel_err"] <= 4e-3, r
        if "past fp16" in r["case"]:
            assert r["act_scaled"] and r["act_max"] > 65504, r  # would overflow an unscaled fp16 act
        if r["case"].startswith("gpt-oss"):
            assert not r["act_scaled"] and r["rel_without_biases"] > 0.1, r  # the biases are added
        assert r["rebased"] == ("stored" not in r["case"]), r
    assert {r["nosort"] for r in rows} == {True, False}


def test_bias_fields_are_validated():
    e, h, i = 4, 64, 32
    q = make_quant(e, h, i, "cpu", biases=True)
    q.validate()
    for name, bad in (
        ("w13_bias", torch.zeros(e, i)),  # [E, I]: the up half missing
        ("w2_bias", torch.zeros(e, h, dtype=torch.bfloat16)),  # fp32 only
    ):
        with pytest.raises(ValueError, match=name):
            replace(q, **{name: bad}).validate()


def test_act_bounds_are_the_largest_row_l1_norms():
    """act_bounds' [E, 4]: the largest L1 norm of a gate row and of an up row of the weights GEMM1 reads
    (rebased or as stored: the same values within the rebase's 1e-5), and the largest |bias| of each half."""
    q = make_quant(4, 256, 128, "cpu", biases=True)
    deq = mxfp8.dequantize(q.w13_weight, q.w13_weight_scale).abs().sum(-1)  # [E, 2I]
    stored = tp.act_bounds(q.w13_weight, q.w13_weight_scale, q.w13_bias, rebased=False)
    assert torch.equal(stored[:, 0], deq[:, :128].amax(1)) and torch.equal(stored[:, 2], deq[:, 128:].amax(1))
    assert torch.equal(stored[:, 1], q.w13_bias[:, :128].abs().amax(1))
    assert torch.equal(stored[:, 3], q.w13_bias[:, 128:].abs().amax(1))
    r13, rs13 = tp.rebase_fp8(q.w13_weight, q.w13_weight_scale, 256)
    rebased = tp.act_bounds(r13, rs13, None, rebased=True)
    assert rel(rebased[:, [0, 2]], stored[:, [0, 2]]) <= 1e-5 and rebased[:, [1, 3]].eq(0).all()


def test_torch_reference_biases_match_transformers_gpt_oss_experts():
    """The torch reference with w13_bias / w2_bias against transformers' GptOssExperts (test-only oracle) on
    the same dequantized weights in its layout (gate / up interleaved along the last dim, [E, H, 2I] and
    [E, I, H]): the bias joins GEMM1 before the clamps, and GEMM2's bias is scaled by the routing weight.
    Both the gathered (decode) and the looped path, fp32, within 1e-5."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    e, h, i, k = 8, 64, 32, 4
    torch.manual_seed(0)
    q = make_quant(e, h, i, "cpu", swiglu=make_swiglu_params(e, 1.702, 1.0, 7.0, "cpu"), biases=True)
    w13 = mxfp8.dequantize(q.w13_weight, q.w13_weight_scale)  # [E, 2I, H] [gate; up]
    w2 = mxfp8.dequantize(q.w2_weight, q.w2_weight_scale)  # [E, H, I]
    experts = GptOssExperts(GptOssConfig(num_local_experts=e, hidden_size=h, intermediate_size=i))
    inter = torch.stack([w13[:, :i], w13[:, i:]], dim=2).reshape(e, 2 * i, h)  # rows g0, u0, g1, u1, ...
    b_inter = torch.stack([q.w13_bias[:, :i], q.w13_bias[:, i:]], dim=2).reshape(e, 2 * i)
    with torch.no_grad():
        experts.gate_up_proj.copy_(inter.transpose(1, 2))
        experts.gate_up_proj_bias.copy_(b_inter)
        experts.down_proj.copy_(w2.transpose(1, 2))
        experts.down_proj_bias.copy_(q.w2_bias)
    routing = MoeRouting(torch.zeros(e, h), torch.zeros(e), k, 1.0)
    for t in (1, 9):  # T*k <= E: gathered; else looped
        x = torch.randn(t, h)
        ids = torch.rand(t, e).topk(k, dim=-1).indices
        w = torch.softmax(torch.randn(t, k), -1)
        with torch.no_grad():
            want = experts(x, router_indices=ids, routing_weights=w)
        got = TorchMoE(q, routing).forward_topk(x, ids, w)
        assert rel(got, want) <= 1e-5, t


def test_fp16_window_is_exact_for_every_e4m3_value():
    # the kernel's fp16 dequant: fp16(e4m3) * fp16(2^(s-127)) must equal the exact fp32 product
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    vals = codes.float()
    vals = vals[torch.isfinite(vals)]
    lo, hi = tp.FP16_EXACT_BYTES
    for s in range(lo, hi + 1):
        sf = torch.tensor(2.0 ** (s - 127))
        exact = vals * sf
        fp16 = (vals.half() * sf.half()).float()
        assert torch.equal(fp16, exact), f"byte {s}"
    big = (vals.half() * torch.tensor(2.0 ** (hi + 1 - 127)).half()).float()
    assert not torch.isfinite(big).all()  # one byte past the window overflows: the bound is tight


def test_weight_shifts_move_bytes_into_window():
    lo, hi = tp.FP16_EXACT_BYTES
    base = torch.randint(lo + 2, lo + 8, (4, 16, 8), dtype=torch.int32)
    base[1] += 40  # expert 1 above the window
    base[2] -= 30  # expert 2 below it
    base[3, 0, 0] = 0  # an all-zero block does not count
    d, ok = tp.weight_shifts(base.to(torch.uint8))
    assert ok and d[0] == 0 and d[1] > 0 and d[2] < 0 and d[3] == 0
    for ex in range(4):
        nz = base[ex][base[ex] > 0] - d[ex]
        assert int(nz.min()) >= lo and int(nz.max()) <= hi
    wide = base.clone()
    wide[0, 0, 1] = lo + 8 + (hi - lo) + 1  # spread of 23 octaves
    assert not tp.weight_shifts(wide.to(torch.uint8))[1]


def test_act_fp16_bound_covers_swiglu_output():
    from runtime.moe.contract import swiglu_oai

    alpha = torch.tensor([1.702, 0.5, 0.05])
    beta = torch.tensor([1.0, -2.0, 1.0])
    limit = torch.tensor([7.0, 100.0, 1.0])
    assert tp.act_fp16_ok(alpha, beta, limit)
    # the bound holds on extreme pre-activations (clamped above, and deep negative gates)
    g = torch.cat(
        [torch.randn(3, 100000, dtype=torch.float64) * 1e4, -torch.rand(3, 1000, dtype=torch.float64) * 100],
        1,
    )
    u = torch.randn_like(g) * 1e4
    act = swiglu_oai(g, u, alpha.double()[:, None], beta.double()[:, None], limit.double()[:, None])
    bound = torch.maximum(limit.double(), 0.2785 / alpha.double()) * (limit.double() + beta.double().abs())
    assert (act.abs().amax(dim=1) <= bound).all()
    assert not tp.act_fp16_ok(alpha, beta, torch.tensor([7.0, 1e4, 7.0]))
    assert not tp.act_fp16_ok(alpha, beta, torch.tensor([7.0, math.inf, 7.0]))
    assert not tp.act_fp16_ok(torch.tensor([1.0, -1.0, 1.0]), beta, limit)


@pytest.mark.parametrize("t", [1, 4, 16, 256, 1024, 4096])
@pytest.mark.parametrize("h,i", [(6144, 3072), (256, 128), (96, 160)])
def test_fit_config_divides_dims(t, h, i):
    for fp8 in (False, True):
        cfg = tc.fit_config(tc.default_config(t, fp8), h, i)
        assert i % cfg.bn1 == 0 and h % cfg.bn2 == 0
        assert h % cfg.bk1 == 0 and i % cfg.bk2 == 0
        assert cfg.bk1 % 32 == 0 and cfg.bk2 % 32 == 0


def _outlier_weights(e: int, n: int, k: int, jitter: int) -> torch.Tensor:
    """[e, n, k] Gaussian weights (sigma 0.02) with outlier columns (every 97th x8) and, with jitter, each
    32-group scaled by 2^j, j uniform in [-jitter, jitter] (a spread of MXFP8 scale bytes within a row)."""
    w = torch.randn(e, n, k) * 0.02
    w[..., ::97] *= 8.0
    if jitter:
        gains = torch.exp2(torch.randint(-jitter, jitter + 1, (e, n, k // 32, 1)).float())
        w = w * gains.repeat_interleave(32, -1).view(e, n, k)
    return w


@pytest.mark.parametrize("jitter", [0, 3])
def test_rebase_fp8_is_a_power_of_two_shift(jitter):
    """FP8 path's load-time rebase: one 2^(S-127) per (row, 128 K) with S the block's largest MXFP8 byte,
    values shifted by whole octaves. Against the MXFP8 values: rel error <= 2e-6 (only values of
    groups far below their block's largest scale lose bits) with per-32 scale jitter of +-jitter
    octaves and outlier columns,
    >= 99.5 % of elements bit-exact; blocks whose four bytes are equal are untouched."""
    e, n, k = 3, 64, 1024
    q, s = mxfp8.quantize(_outlier_weights(e, n, k, jitter))
    q2, sc = tp.rebase_fp8(q, s)
    assert q2.dtype == torch.float8_e4m3fn and sc.shape == (e, n, k // 128)
    top = s.view(e, n, k // 128, 4).amax(-1).int()
    assert torch.equal(sc, mxfp8.pow2(top - 127))
    ref = mxfp8.dequantize(q, s)
    got = (q2.float().view(e, n, k // 128, 128) * sc[..., None]).view(e, n, k)
    assert rel(got, ref) <= 2e-6
    assert (got == ref).float().mean() >= 0.995
    flat = s.view(e, n, k // 128, 4)
    same = (flat == flat[..., :1]).all(-1)  # [e, n, K/128] blocks with one byte
    assert same.any()
    assert torch.equal(
        q2.view(e, n, k // 128, 128)[same].view(torch.uint8),
        q.view(e, n, k // 128, 128)[same].view(torch.uint8),
    )


@pytest.mark.parametrize("jitter", [0, 3])
def test_rebase_fp8_one_scale_per_row(jitter):
    """The per-row rebase (FP8_ROW_SCALE) at MiniMax-M3's K = 6144: sc [E, N, 1] is 2^(row's largest byte
    - 127); against the MXFP8 values rel error <= 1e-5 (measured 1.1e-6 / 6.5e-6 for jitter 0 / 3) and
    >= 99 % of elements bit-exact."""
    torch.manual_seed(0)
    e, n, k = 2, 32, 6144
    q, s = mxfp8.quantize(_outlier_weights(e, n, k, jitter))
    q2, sc = tp.rebase_fp8(q, s, k)
    assert sc.shape == (e, n, 1)
    assert torch.equal(sc[..., 0], mxfp8.pow2(s.int().amax(-1) - 127))
    ref = mxfp8.dequantize(q, s)
    got = q2.float() * sc
    assert rel(got, ref) <= 1e-5
    assert (got == ref).float().mean() >= 0.99


def test_row_scale_falls_back_to_128_blocks_past_13_octaves():
    """FP8_ROW_SCALE asks for one rebased scale per row; a layer with a row whose MXFP8 scale bytes span more
    than ROW_SCALE_MAX_OCTAVES (byte-0 groups ignored) keeps one per 128 K instead, and fp8_row_scale says so.
    Within the limit, every value of the per-row rebase is within half an e4m3 ulp at its group's amax."""
    q = make_quant(2, 256, 128, "cpu")
    p = prepared(q, rebase=False)  # the copy made on request
    s13 = p.w13_scale.int()
    spread = int((s13.amax(-1) - s13.masked_fill(s13 == 0, 255).amin(-1)).max())
    assert spread <= tp.ROW_SCALE_MAX_OCTAVES and tp.row_scale_ok(p.w13_scale) and tp.row_scale_ok(p.w2_scale)
    w13, sc13, _, _ = p.fp8_weights(True)
    assert p.fp8_row_scale and sc13.shape == (2, 256, 1)
    ref = mxfp8.dequantize(p.w13, p.w13_scale)  # [E, N, K]
    half_ulp = mxfp8.pow2(p.w13_scale.int() - 127 + 3).repeat_interleave(32, -1)  # 8 x the group's scale
    assert bool(((w13.float() * sc13 - ref).abs() <= half_ulp).all())
    wide = p.w13_scale.clone()
    wide[0, 5, 0] = int(wide[0, 5].max()) - tp.ROW_SCALE_MAX_OCTAVES - 1  # one group 14 octaves down
    assert tp.row_scale_ok(p.w13_scale) and not tp.row_scale_ok(wide)
    zeroed = p.w13_scale.clone()
    zeroed[0, 5, 0] = 0  # an all-zero group: exact at any shift
    assert tp.row_scale_ok(zeroed)
    p.w13_scale, p.fp8_blocks = wide, None  # another layer's weights
    _, sc13, _, sc2 = p.fp8_weights(True)  # w13 [2, 256, 256]: K / 128 = 2 blocks per row; w2 K = 128: 1
    assert not p.fp8_row_scale and sc13.shape == (2, 256, 2) and sc2.shape == (2, 256, 1)
    assert p.fp8_weights(True)[1] is sc13  # made once per request


def test_prepare_rebases_at_load_where_row_scales_hold():
    """prepare (rebase=True, the default) keeps the experts as e4m3 with one fp32 power-of-two scale per
    row (WMODE 7 on both GEMMs), within 1e-5 relative of the MXFP8 values, and the FP8 path reads those
    same tensors; a row spanning more than ROW_SCALE_MAX_OCTAVES or rebase=False keep the weights as stored.
    A SwiGLU bound past fp16 (limit inf) is rebased too, with act scaled per row (act_bound)."""
    q = make_quant(4, 256, 128, "cpu", swiglu=make_swiglu_params(4, 1.702, 1.0, 7.0, "cpu"))
    args = (q.w13_weight, q.w13_weight_scale, q.w2_weight, q.w2_weight_scale)
    swiglu = (q.gemm1_alpha, q.gemm1_beta, q.gemm1_clamp_limit)
    p = tp.prepare(*args, *swiglu)
    assert p.rebased and (p.wmode1, p.wmode2) == (7, 7) and p.fp16_1 and p.fp16_2
    assert p.w13.dtype == torch.float8_e4m3fn and p.w13_scale.dtype == torch.float32
    assert p.w13_scale.shape == (4, 256, 1) and p.w2_scale.shape == (
        4,
        256,
        1,
    )  # w13 [4, 2I, H], w2 [4, H, I]
    for w, sc, (wq, ws) in ((p.w13, p.w13_scale, args[:2]), (p.w2, p.w2_scale, args[2:])):
        ref = mxfp8.dequantize(wq, ws)
        assert rel(w.float() * sc, ref) <= 1e-5
    assert p.fp8_weights_fit() and all(
        a is b for a, b in zip(p.fp8_weights(False), (p.w13, p.w13_scale, p.w2, p.w2_scale))
    )
    assert p.fp8_row_scale and p.fp8_blocks is None  # no second copy
    wide = q.w13_weight_scale.clone()
    wide[0, 5, 0] = int(wide[0, 5].max()) - tp.ROW_SCALE_MAX_OCTAVES - 1
    assert not tp.prepare(args[0], wide, *args[2:], *swiglu).rebased
    inf_limit = make_swiglu_params(4, 1.702, 1.0, math.inf, "cpu")
    unbounded = tp.prepare(
        *args, inf_limit["gemm1_alpha"], inf_limit["gemm1_beta"], inf_limit["gemm1_clamp_limit"]
    )
    assert unbounded.rebased and unbounded.fp16_2 and unbounded.act_bound.shape == (4, 4)
    assert p.act_bound is None  # M3's parameters bound act: stored as it is
    kept = tp.prepare(*args, *swiglu, rebase=False)
    assert not kept.rebased and kept.w13 is args[0] and kept.wmode1 == 1


def test_rebase_at_load_needs_room_on_the_device(monkeypatch, caplog):
    """Until the layer drops the stored tensors, the rebase holds both copies: with less free device memory
    than REBASE_MARGIN x rebase_bytes (rebased e4m3 + fp32 row scales + one expert's fp32 temporaries) the
    layer keeps the stored layout and says so once, instead of running out of memory at load."""
    q = make_quant(4, 256, 128, "cpu", swiglu=make_swiglu_params(4, 1.702, 1.0, 7.0, "cpu"))
    args = (
        q.w13_weight,
        q.w13_weight_scale,
        q.w2_weight,
        q.w2_weight_scale,
        q.gemm1_alpha,
        q.gemm1_beta,
        q.gemm1_clamp_limit,
    )
    need = tp.rebase_bytes(q.w13_weight, q.w2_weight)  # w13 [4, 256, 256], w2 [4, 256, 128]
    assert need == 4 * 256 * 256 + 4 * 256 * 128 + 4 * 4 * (256 + 256) + 2 * 4 * 256 * 256
    assert tp.device_free_bytes(torch.device("cpu")) is None and tp.prepare(*args).rebased  # host: no check
    monkeypatch.setattr(tp, "_REBASE_NO_ROOM_WARNED", [])
    monkeypatch.setattr(tp, "device_free_bytes", lambda dev: int(tp.REBASE_MARGIN * need) - 1)
    with caplog.at_level("WARNING", logger="porter.runtime"):
        kept = tp.prepare(*args)
        tp.prepare(*args)
    assert not kept.rebased and kept.w13 is q.w13_weight and kept.wmode1 == 1
    warnings = [r for r in caplog.records if "kept as stored" in r.getMessage()]
    assert len(warnings) == 1 and "GB free" in warnings[0].getMessage()
    monkeypatch.setattr(tp, "device_free_bytes", lambda dev: int(tp.REBASE_MARGIN * need) + 1)
    assert tp.prepare(*args).rebased


def test_prefill_path_choice():
    assert tc.default_config(tc.FP8_PREFILL_MIN_TOKENS, True).fp8 == tc.FP8_TERMS
    assert tc.default_config(4096, True).fp8 == tc.FP8_TERMS
    assert tc.default_config(tc.FP8_PREFILL_MIN_TOKENS - 1, True).fp8 == 0
    assert all(tc.default_config(t, False).fp8 == 0 for t in (1, 256, 4096))


def test_pdl_and_fused_output_gates_on_cpu():
    assert not pdl_supported(torch.device("cpu"))
    assert not tl.fp8_prefill_supported(torch.device("cpu"))
    assert tc.FUSED_OUT_MAX_TOKENS >= 256 and tc.NOSORT_MAX_TOKENS >= 4


def test_fp8_prefill_copy_is_skipped_when_it_does_not_fit(monkeypatch):
    """A resident model leaves no room for the FP8 path's rebased copy of the experts: the check says
    no (prefill then stays on W8A16) instead of allocating it and dying out of memory."""
    q = make_quant(4, 256, 128, "cpu")
    p = prepared(q, rebase=False)  # the copy would be a second one
    need = (p.w13.numel() + p.w2.numel()) * (1 + 4 / tc.FP8_BLOCK_K)  # 4*256*256 + 4*256*128 elements
    assert need == (4 * 256 * 256 + 4 * 256 * 128) * (1 + 4 / 128)
    monkeypatch.setattr(tp, "device_free_bytes", lambda dev: int(need))
    assert not p.fp8_weights_fit()  # needs FP8_COPY_MARGIN (25%) on top
    monkeypatch.setattr(tp, "device_free_bytes", lambda dev: int(tp.FP8_COPY_MARGIN * need) + 1)
    assert p.fp8_weights_fit()
    assert p.fp8_blocks is None  # the check allocates nothing


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("t", [1, 4, 64, 600, 4096])
def test_serving_numerics_match_the_torch_reference(t):
    """numerics="serving" (MXFP8 input and SwiGLU output, as the TRT-LLM kernel) at MiniMax-M3's H and I, with
    per-expert alpha/beta/limit and outlier tokens: Triton within 5e-3 of the torch reference in the same mode
    (both read the same MXFP8 values; only fp32 summation order and the 16-bit store of GEMM1's output
    differ), and both clearly away from the W8A16 numerics (the activation rounding is the larger error)."""
    torch.manual_seed(t)
    h, i, e, k = 6144, 3072, 8, 4
    quant = make_quant(e, h, i, "cuda")
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, 2.5)
    x = torch.randn(t, h, device="cuda")
    x[:: max(1, t // 3)] *= 40  # outlier tokens: their blocks take larger scales
    x = x.to(torch.bfloat16)
    ids, w = skewed_routing(t, e, k, "cuda")
    ref = TorchMoE(quant, routing, numerics="serving").forward_topk(x, ids, w)
    out = TritonMoE(quant, routing, numerics="serving").forward_topk(x, ids, w)
    w8a16 = TorchMoE(quant, routing).forward_topk(x, ids, w)
    assert torch.isfinite(out).all()
    assert rel(out, ref) <= 5e-3, rel(out, ref)
    assert rel(ref, w8a16) >= 1e-2, rel(ref, w8a16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
def test_serving_numerics_decode_is_capturable():
    """The serving path syncs nowhere: a decode call captured in a CUDA graph replays to the eager result."""
    h, i, e, k = 6144, 3072, 8, 4
    quant = make_quant(e, h, i, "cuda")
    routing = MoeRouting(torch.randn(e, h, device="cuda") * 0.05, torch.zeros(e, device="cuda"), k, 2.5)
    moe = TritonMoE(quant, routing, numerics="serving")
    x = torch.randn(1, h, device="cuda").to(torch.bfloat16)
    eager = moe(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe(x)
    g.replay()
    torch.cuda.synchronize()
    assert rel(out, eager) <= 1e-3


def _hostile_rows(dtype) -> torch.Tensor:
    """Rows of 96 (three MXFP8 blocks) covering the quantizer's cases: random at every magnitude,
    outliers, all-zero blocks, fp32 subnormal amax (byte 0 and the 2^-127 boundary), values near the
    fp32 and bf16 maximum, e4m3 rounding ties and carries, NaN and Inf."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(80, 96, generator=g) * torch.logspace(-30, 30, 80)[:, None]
    x[0] = 0
    x[1, :32] = 0
    x[2, 5] = float("nan")
    x[3, 40] = float("inf")
    x[4] = torch.randn(96, generator=g) * 2.0**-130
    x[5, :32] = 448 * 2.0**-127 * (1 + torch.arange(32) / 1e6)
    x[6] = torch.randn(96, generator=g).clamp(-5, 5) * 6e37  # up to 3e38, finite
    x[7, :32] = 448 * 2.0**-127
    x[8, :32] = torch.nextafter(torch.tensor(448 * 2.0**-127), torch.tensor(1.0))
    x[9, :32] = torch.tensor([448.0] + [1.0625, 17.0, 100.0, 127.4, 0.0029296875 * 2**-6] * 6 + [-1.0])
    x[10, 32:64] = torch.randn(32, generator=g) * 1e4
    x[10, 40] = 3e6  # an outlier inside a block
    return x.to(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (SM80+)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_mxfp8_rounding_is_bit_identical_to_the_activation_quantizer(dtype):
    """The serving kernels' in-register MXFP8 rounding (kernels._mxfp8_round) returns exactly
    porter.format.mxfp8.fake_quantize_activations computed on the CPU (the quantizer proven bit-identical
    to FlashInfer's and the engines' quantizers), NaN where it gives NaN, +0 where it gives +0."""
    from runtime.moe.triton import kernels as K

    x = _hostile_rows(dtype)
    y = torch.empty_like(x, device="cuda")
    K.mxfp8_round_kernel[(x.shape[0],)](x.cuda(), y, x.shape[1], CP=128)
    want, got = mxfp8.fake_quantize_activations(x), y.cpu()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
    assert bool(same.all()), [
        (r, c, float(x[r, c]), float(got[r, c]), float(want[r, c])) for r, c in (~same).nonzero()[:5].tolist()
    ]
    assert int(want.isnan().sum()) == 64  # the two rows' bad blocks, NaN in full
