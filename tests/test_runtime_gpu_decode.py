"""Decode on CUDA (run on the H200; skipped without a GPU): CUDA-graph decode equals eager decode, the
fused decode step equals the op-by-op one, the Triton decode attention, GEMV (bf16 / MXFP8, epilogues),
q/k/v post-processing, indexer and router kernels against their torch references at MiniMax-M3's real
dims, the GPU model against the CPU model step by step, and a device_map split over two GPUs against one GPU."""

from __future__ import annotations

import pytest
import runtime_fixtures as fx
import torch

import porter
import runtime
from porter.format import mxfp8
from runtime.graph import DecodeGraph
from runtime.kernels import gemv
from runtime.kernels.attention import decode_attention, decode_attention_reference
from runtime.models.layers import rms_norm_reference
from runtime.placement import store_sizes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu-decode")
    src = fx.vendor_checkpoint(base / "src", seed=6)
    out = {}
    for scope in ("experts", "all"):
        out[scope] = base / f"mxfp8-{scope}"
        porter.convert(src, out[scope], quantize=scope, progress=False)
    return out


def _left_pad(lengths, seed=1):
    return fx.left_pad([fx.prompt(n, batch=1, seed=seed + b)[0] for b, n in enumerate(lengths)])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_decode_equals_eager(artifacts, backend):
    model = runtime.load(artifacts["experts"], device="cuda", backend=backend)  # bf16
    ids, mask = _left_pad([5, 12, 30])
    n = 24  # crosses the sparse threshold (8 keys) for every row
    caches = [model.new_cache(3, ids.shape[1] + n) for _ in range(2)]
    la = model(ids.cuda(), caches[0], attention_mask=mask)[:, -1]
    lb = model(ids.cuda(), caches[1], attention_mask=mask)[:, -1]
    graph = DecodeGraph(model, caches[1])
    for step in range(n):
        tok = la.argmax(-1, keepdim=True)
        assert torch.equal(tok, lb.argmax(-1, keepdim=True)), step
        la = model(tok, caches[0])[:, -1]
        lb = graph(tok)
        err = fx.rel(lb, la)
        assert err <= 1e-3, (step, err)  # same kernels; only atomics' summation order may differ
    assert caches[1].length == caches[0].length and torch.equal(caches[1].next_pos, caches[0].next_pos)
    out_graph = model.generate(ids.cuda(), 16, attention_mask=mask, cuda_graph=True)
    out_eager = model.generate(ids.cuda(), 16, attention_mask=mask, cuda_graph=False)
    assert torch.equal(model.generate(ids.cuda(), 16, attention_mask=mask), out_graph)  # the default
    assert torch.equal(out_graph, out_eager)


def test_generate_reuses_its_captured_step(artifacts):
    """A second generate call of the same batch and cache size replays the step captured by the first
    (no second capture) over the emptied cache, and its tokens equal a fresh eager run; another batch size
    captures anew."""
    model = runtime.load(artifacts["experts"], device="cuda", backend="triton")
    first, _ = _left_pad([5, 12, 30], seed=3)
    second, mask = _left_pad([9, 20, 30], seed=4)  # the same width: the same cache size
    model.generate(first.cuda(), 16)
    key, cache, graph = model.decode_state
    got = model.generate(second.cuda(), 16, attention_mask=mask)
    assert model.decode_state[1] is cache and model.decode_state[2] is graph
    assert torch.equal(got, model.generate(second.cuda(), 16, attention_mask=mask, cuda_graph=False))
    single = model.generate(second[:1].cuda(), 16)
    assert model.decode_state[0] == (1, key[1]) and model.decode_state[2] is not graph
    assert torch.equal(single, model.generate(second[:1].cuda(), 16, cuda_graph=False))
    model.release_decode_state()
    assert model.decode_state is None


def test_cuda_graph_segments_hand_off_the_residual(artifacts):
    """The hand-off between per-device graphs, exercised on one GPU by cutting after layers 0 and 2: the
    same logits as one graph, step after step (same kernels in the same order)."""
    model = runtime.load(artifacts["experts"], device="cuda", backend="triton")
    ids, mask = _left_pad([5, 12, 30])
    n = 12
    caches = [model.new_cache(3, ids.shape[1] + n) for _ in range(2)]
    la = model(ids.cuda(), caches[0], attention_mask=mask)[:, -1]
    lb = model(ids.cuda(), caches[1], attention_mask=mask)[:, -1]
    whole, cut = DecodeGraph(model, caches[0]), DecodeGraph(model, caches[1], split_after=(0, 2))
    assert len(whole.segments) == 1 and [(s.first, s.last) for s in cut.segments] == [(0, 2), (2, 4), (4, 6)]
    for step in range(n):
        tok = la.argmax(-1, keepdim=True)
        la, lb = whole(tok).clone(), cut(tok).clone()
        assert fx.rel(lb, la) <= 1e-3, (step, fx.rel(lb, la))


@pytest.mark.parametrize("numerics, bound", [(None, 1e-4), ("serving", 1e-2)])
def test_cuda_decode_matches_cpu_step_by_step(artifacts, numerics, bound):
    """fp32 on both: Triton decode attention + MXFP8 linears (quantize all) vs the CPU reference path. In the
    serving numerics every linear's input is rounded to MXFP8 (on CUDA before the GEMV kernels), where an fp32
    difference of 1e-6 can move a value across an e4m3 rounding boundary: hence the looser bound."""
    cpu = runtime.load(artifacts["all"], device="cpu", backend="torch", moe_numerics=numerics)
    gpu = runtime.load(
        artifacts["all"], device="cuda", dtype=torch.float32, backend="torch", moe_numerics=numerics
    )
    ids, mask = _left_pad([7, 20])
    cc, gc = cpu.new_cache(2, 40), gpu.new_cache(2, 40)
    lc, lg = cpu(ids, cc, attention_mask=mask)[:, -1], gpu(ids.cuda(), gc, attention_mask=mask)[:, -1]
    assert fx.rel(lg.cpu(), lc) <= bound
    for step in range(16):
        tok = lc.argmax(-1, keepdim=True)
        lc, lg = cpu(tok, cc)[:, -1], gpu(tok.cuda(), gc)[:, -1]
        assert fx.rel(lg.cpu(), lc) <= bound, step
    if numerics == "serving":  # the captured step computes the same serving numerics as the eager one
        out = gpu.generate(ids.cuda(), 8, attention_mask=mask, cuda_graph=True)
        assert torch.equal(out, gpu.generate(ids.cuda(), 8, attention_mask=mask, cuda_graph=False))


@pytest.mark.parametrize("sparse", [False, True])
def test_triton_decode_attention_at_real_dims(sparse):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, nq, nkv, d, block, s_max, topk = 2, 64, 4, 128, 128, 8192, 16
    q = torch.randn(B, nq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(B, nkv, s_max, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(B, nkv, s_max, d, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = torch.tensor([1000, 8191], device="cuda")
    blocks = None
    if sparse:
        nblk = s_max // block
        pick = lambda p: torch.nn.functional.pad(
            torch.randperm(p // block + 1, device="cuda")[:topk],
            (0, max(0, topk - (p // block + 1))),
            value=nblk,
        )
        blocks = torch.stack(
            [torch.stack([pick(p) for _ in range(nkv)]) for p in pos.tolist()]
        )  # [B, nkv, topk]
    want = decode_attention_reference(q.float(), k.float(), v.float(), pos, s_max, blocks, block, d**-0.5)
    got = decode_attention(q, k, v, pos, s_max, blocks, block, d**-0.5)
    assert got.dtype == torch.bfloat16
    assert fx.rel(got.float(), want) <= 1e-2


def _real_dims_attention(B, s_max, seed, dtype=torch.bfloat16):
    """q [B, 64, 128], K/V caches [B, 4, s_max, 128] at MiniMax-M3's attention dims."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 64, 128, device="cuda", generator=g, dtype=dtype)
    k, v = (torch.randn(B, 4, s_max, 128, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def _block_scores(B, s_max, pos, seed):
    """The decode indexer's block scores [B, 4, s_max/128] over random index keys (2 local blocks and 1
    init block kept: +inf ties; blocks past a row's position: -inf)."""
    from runtime.kernels import fused

    g = torch.Generator(device="cuda").manual_seed(seed)
    iq = torch.randn(B, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    keys = torch.randn(B, s_max, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    return fused.index_scores(iq, keys, pos, s_max, 128, 2, 1)


@pytest.mark.parametrize("pos", [[8191], [130, 3000, 8191]], ids=["batch1", "batch3-left-padded"])
def test_in_kernel_topk_attention_equals_topk_kernel(pos):
    """decode_attention_topk with the top-k picked inside the split-K kernel against the index_topk kernel
    + the same attention over its blocks, and the fp32 SDPA reference, at real dims and KV 8k: the same
    blocks and the same output bits; repeated calls and CUDA-graph replays give the same bits."""
    from runtime.kernels import attention as A
    from runtime.kernels import fused

    B, s_max, topk, block, scale = len(pos), 8192, 16, 128, 128**-0.5
    pos_t = torch.tensor(pos, device="cuda")
    q, k, v = _real_dims_attention(B, s_max, seed=5)
    scores = _block_scores(B, s_max, pos_t, seed=6)  # [B, 4, 64]
    assert bool((scores == float("inf")).any()) and (B == 1 or bool((scores == float("-inf")).any()))
    out, top = A.decode_attention_topk(q, k, v, pos_t, s_max, scores, topk, block, scale)
    assert torch.equal(top, fused.index_topk(scores, topk)) and torch.equal(top, A.top_blocks(scores, topk))
    want = decode_attention_reference(q.float(), k.float(), v.float(), pos_t, s_max, top, block, scale)
    assert out.dtype == torch.bfloat16 and fx.rel(out.float(), want) <= 1e-2
    out2, top2 = A.decode_attention_topk(q, k, v, pos_t, s_max, scores, topk, block, scale, rank_blocks=0)
    assert torch.equal(top2, top) and torch.equal(out2, out)  # same blocks in the same order: same sums
    qs = [_real_dims_attention(B, 16, seed=10 + i)[0] for i in range(3)]
    eager = [A.decode_attention_topk(qi, k, v, pos_t, s_max, scores, topk, block, scale)[0] for qi in qs]
    assert all(
        torch.equal(A.decode_attention_topk(qi, k, v, pos_t, s_max, scores, topk, block, scale)[0], e)
        for qi, e in zip(qs, eager)
    )
    static_q = qs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        A.decode_attention_topk(static_q, k, v, pos_t, s_max, scores, topk, block, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_top = A.decode_attention_topk(static_q, k, v, pos_t, s_max, scores, topk, block, scale)
    for rep in range(2):
        for i, qi in enumerate(qs):
            static_q.copy_(qi)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(g_out, eager[i]) and torch.equal(g_top, top), (rep, i)


def test_in_kernel_topk_attention_fp32():
    """fp32 (IEEE dots): the in-kernel top-k attention and the dense attention within 1e-5 of the fp32 SDPA
    reference, two rows at different positions (one sees 1 of the 32 blocks)."""
    from runtime.kernels import attention as A

    pos = torch.tensor([4000, 77], device="cuda")
    q, k, v = _real_dims_attention(2, 4096, seed=7, dtype=torch.float32)
    scores = _block_scores(2, 4096, pos, seed=8)
    out, top = A.decode_attention_topk(q, k, v, pos, 4096, scores, 16, 128, 0.1)
    assert torch.equal(top, A.top_blocks(scores, 16))
    assert fx.rel(out, decode_attention_reference(q, k, v, pos, 4096, top, 128, 0.1)) <= 1e-5
    assert (
        fx.rel(decode_attention(q, k, v, pos, 4096), decode_attention_reference(q, k, v, pos, 4096)) <= 1e-5
    )


@pytest.mark.parametrize("n,k", [(8192 + 3 * 512 + 128, 6144), (6144, 8192)])  # stacked q/k/v/index; o_proj
def test_gemv_at_real_dims(n, k):
    """runtime.kernels.gemv (bf16 and MXFP8 weights) against the torch matmul of the same values."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    q, s = mxfp8.quantize(w)
    wb = w.bfloat16()
    deq = mxfp8.dequantize(q, s)  # fp32
    for rows in (1, 8, 32, 64):
        x = torch.randn(rows, k, device="cuda", generator=g, dtype=torch.bfloat16)
        assert gemv.applies(x, wb) and gemv.applies(x, q)
        assert fx.rel(gemv.gemv(x, q, s).float(), x.float() @ deq.t()) <= 1e-2
        if rows in (1, 32):  # 16-bit weights and fp32 activations (smaller K steps: shared memory)
            assert fx.rel(gemv.gemv(x, wb).float(), x.float() @ wb.float().t()) <= 1e-2
            assert fx.rel(gemv.gemv(x.float(), q, s), x.float() @ deq.t()) <= 1e-5
            assert fx.rel(gemv.gemv(x.float(), wb), x.float() @ wb.float().t()) <= 1e-5
    assert not gemv.applies(torch.zeros(65, k, device="cuda", dtype=torch.bfloat16), q)


@pytest.mark.parametrize("n,k", [(8192 + 3 * 512 + 128, 6144), (6144, 8192), (6144, 3072), (37, 1000)])
def test_gemv_stream_at_real_dims(n, k):
    """runtime.kernels.gemv.gemv_stream (bf16 and fp16, 1-4 rows, ragged N and K) against an fp32 matmul of the same
    values; only one bf16/fp16 row takes it in a model (gemv.streams)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    for dtype in (torch.bfloat16, torch.float16):
        wd = w.to(dtype)
        for rows in (1, 2, 3, 4):
            x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
            for cfg in (None, (8, 512, 4), (16, 256, 4)):
                y = gemv.gemv_stream(x, wd, cfg=cfg)
                assert y.dtype == dtype and y.shape == (rows, n)
                assert fx.rel(y.float(), x.float() @ wd.float().t()) <= 5e-3, (dtype, rows, cfg)
            assert gemv.streams(x, wd) == (rows == 1)
    assert not gemv.streams(torch.zeros(1, k, device="cuda"), w)  # fp32 stays on Linear's own path


def test_gemv_epilogues_equal_the_unfused_ops():
    """SwiGLU epilogue == GEMV then fused.swiglu (bf16 rounding); residual adds bit-equal to adding after."""
    from runtime.kernels import fused

    g = torch.Generator(device="cuda").manual_seed(1)
    H, inter = 6144, 3072
    w13 = (torch.randn(2 * inter, H, device="cuda", generator=g) / H**0.5).bfloat16()  # [gate; up]
    w2 = (torch.randn(H, inter, device="cuda", generator=g) / inter**0.5).bfloat16()
    params = (1.702, 1.0, 7.0)
    for rows in (1, 8, 32):
        x = torch.randn(rows, H, device="cuda", generator=g, dtype=torch.bfloat16)
        both = gemv.gemv(x, w13)  # [rows, 2I]
        want = fused.swiglu(both[:, :inter], both[:, inter:], *params)
        act = gemv.gemv(x, w13, swiglu=params)  # other tile shape: the same sums up to fp32 rounding
        assert fx.rel(act.float(), want.float()) <= 1e-2
        a1 = torch.randn(rows, H, device="cuda", generator=g, dtype=torch.bfloat16)
        a2 = torch.randn(rows, H, device="cuda", generator=g, dtype=torch.bfloat16)
        y = gemv.gemv(act, w2)
        assert torch.equal(gemv.gemv(act, w2, add=(a1,)), y + a1)
        assert torch.equal(gemv.gemv(act, w2, add=(a1, a2)), (y + a1) + a2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_kernels_equal_torch_adds_and_norm(dtype):
    """add_rms_norm == (h + a, rms_norm(h + a)) and add_chain == (x0 + x1) + x2, bit for bit (1, 8 and 32
    rows at H 6144)."""
    from runtime.kernels import fused

    g = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(6144, device="cuda", generator=g, dtype=dtype) * 0.1
    for rows in (1, 8, 32):
        a, h, c = (
            torch.randn(rows, 1, 6144, device="cuda", generator=g, dtype=dtype) * s for s in (1, 30, 3)
        )
        hout, y = fused.add_rms_norm(a, h, w, 1e-6)
        assert torch.equal(hout, h + a)
        assert torch.equal(y, fused.rms_norm(h + a, w, 1e-6))
        # against torch ops (minimax_m3.rms_norm would run the same kernel on CUDA)
        assert fx.rel(y.float(), rms_norm_reference(h + a, w, 1e-6).float()) <= (
            1e-6 if dtype == torch.float32 else 8e-3
        )
        assert torch.equal(fused.add_chain(a, h), a + h)
        assert torch.equal(fused.add_chain(a, h, c), (a + h) + c)


def test_router_kernels_equal_route():
    """router_logits == x.float() @ W^T (fp32) and router_select == select_experts (same ids, best first)."""
    from runtime.kernels import fused
    from runtime.moe.contract import select_experts

    g = torch.Generator(device="cuda").manual_seed(2)
    for T, E, k in ((1, 128, 4), (32, 128, 4), (5, 8, 2)):
        # the weight first: the kernel reads it before its PDL wait, so the kernel just before must not write it
        w = torch.randn(E, 6144, device="cuda", generator=g)
        x = torch.randn(T, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
        assert fx.rel(fused.router_logits(x, w), x.float() @ w.t()) <= 1e-6
        logits = torch.randn(T, E, device="cuda", generator=g) * 3
        bias = torch.randn(E, device="cuda", generator=g) * 0.1
        ids, w = fused.router_select(logits, bias, k)
        want_ids, want_w = select_experts(logits, bias, k)
        assert torch.equal(ids, want_ids)  # both best first; random logits: no ties
        assert torch.allclose(w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sparse", [False, True])
def test_decode_qkv_equals_norm_rope_and_cache_writes(sparse):
    """fused.decode_qkv == norm_rope on each head + LayerCache.put, at real dims (bit-equal in bf16)."""
    from runtime.kernels import fused
    from runtime.models.layers import Rope, norm_rope

    g = torch.Generator(device="cuda").manual_seed(3)
    B, nq, nkv, d, ni, di, S, r = 3, 64, 4, 128, 4, 128, 1024, 64
    n = nq * d + 2 * nkv * d + (ni * di + di if sparse else 0)
    qkv = torch.randn(B, n, device="cuda", generator=g, dtype=torch.bfloat16)
    norms = [torch.randn(x, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1 for x in (d, d, di, di)]
    pos = torch.tensor([5, 700, 1023], device="cuda")
    cos, sin = Rope(r, 5e6, "cuda")(pos[:, None], torch.bfloat16)  # [B, 1, r]
    caches = [torch.zeros(B, nkv, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    idx = (
        [torch.zeros(B, S, di, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        if sparse
        else [None, None]
    )
    q, iq = fused.decode_qkv(
        qkv,
        pos,
        cos,
        sin,
        norms if sparse else norms[:2],
        (nq, nkv, d, ni, di) if sparse else (nq, nkv, d),
        caches[0],
        caches[1],
        1e-6,
        idx[0],
    )
    x = qkv[:, None]  # [B, 1, n]
    want_q = norm_rope(x[..., : nq * d].reshape(B, 1, nq, d), norms[0], 1e-6, cos, sin)[:, 0]
    want_k = norm_rope(x[..., nq * d : (nq + nkv) * d].reshape(B, 1, nkv, d), norms[1], 1e-6, cos, sin)
    want_v = x[..., (nq + nkv) * d : (nq + 2 * nkv) * d].reshape(B, 1, nkv, d)
    rows = torch.arange(B, device="cuda")
    caches[2][rows, :, pos] = want_k[:, 0]
    caches[3][rows, :, pos] = want_v[:, 0]
    assert torch.equal(q, want_q) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    if sparse:
        base = (nq + 2 * nkv) * d
        want_iq = norm_rope(x[..., base : base + ni * di].reshape(B, 1, ni, di), norms[2], 1e-6, cos, sin)[
            :, 0
        ]
        want_ik = norm_rope(x[..., base + ni * di :].reshape(B, 1, 1, di), norms[3], 1e-6, cos, sin)[:, 0, 0]
        idx[1][rows, pos] = want_ik
        assert torch.equal(iq, want_iq) and torch.equal(idx[0], idx[1])
    else:
        assert iq is None
    # one position for every row as Step.of builds it (expand: stride 0) writes the same slots as a copy
    same = torch.tensor([700], device="cuda").expand(B)
    c_exp, c_copy = ([torch.zeros_like(caches[0]) for _ in range(2)] for _ in range(2))
    for p_, (kc, vc) in ((same, c_exp), (same.contiguous(), c_copy)):
        fused.decode_qkv(qkv, p_, cos, sin, norms[:2], (nq, nkv, d), kc, vc, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(c_exp, c_copy)) and bool(
        c_exp[0][:, :, 700].abs().sum(-1).gt(0).all()
    )


def test_index_kernels_equal_the_torch_indexer():
    """fused.index_scores + index_topk == Indexer.select's torch scoring at real dims (same blocks per query)."""
    from types import SimpleNamespace

    from runtime.cache import Step
    from runtime.kernels import fused
    from runtime.models.indexer import Indexer

    g = torch.Generator(device="cuda").manual_seed(4)
    B, ni, di, S, block, topk = 3, 4, 128, 8192, 128, 16
    cfg = SimpleNamespace(
        index_block_size=block, index_topk_blocks=topk, index_local_blocks=2, index_init_blocks=1
    )
    iq = torch.randn(B, ni, di, device="cuda", generator=g, dtype=torch.bfloat16)
    keys = torch.randn(B, S, di, device="cuda", generator=g, dtype=torch.bfloat16)
    pos = torch.tensor([3000, 8191, 130], device="cuda")
    got = fused.index_topk(fused.index_scores(iq, keys, pos, S, block, 2, 1), topk)[
        :, :, None
    ]  # [B, ni, 1, topk]
    ix = Indexer.__new__(Indexer)
    ix.cfg = cfg
    step = Step(pos[:, None], None, S, decode=True)
    scores = torch.einsum("bhd,bsd->bhs", iq.float(), keys.float())[:, :, None]  # [B, ni, 1, S]
    scores = scores.masked_fill(torch.arange(S, device="cuda") > pos[:, None, None, None], float("-inf"))
    blocks = scores.view(B, ni, 1, S // block, block).amax(-1)
    forced = ix._forced_blocks(step.pos // block)
    blocks.scatter_(-1, forced[:, None].expand(B, ni, -1, -1), float("inf"))
    top_s, top_i = blocks.topk(topk, dim=-1)
    want = top_i.masked_fill(top_s == float("-inf"), S // block)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert int((got == S // block).sum()) == int((want == S // block).sum()) > 0  # row 2 sees 2 blocks only


def test_decode_is_deterministic_and_graph_replay_matches(artifacts):
    """Decode (fused kernels, the shared expert on a second stream) run twice on the same inputs gives the
    same bits (the streams join before the adds, in the unfused rounding order), and the CUDA-graph replay of
    the step is within bf16 rounding of it (fp32: 1e-5); both scopes, a left-padded batch of 3 and batch 1."""
    for scope, dtype, tol in (("experts", torch.bfloat16, 2e-2), ("all", torch.float32, 1e-5)):
        model = runtime.load(
            artifacts[scope], device="cuda", dtype=dtype, backend="triton" if scope == "experts" else "torch"
        )
        assert model.layers[1].self_attn.qkv is not None and model.layers[0].mlp.gate_up is not None
        for lengths in ([5, 12, 30], [17]):  # batch 1 takes the MoE's one-token fused output
            ids, mask = _left_pad(lengths)
            n = 12
            caches = [model.new_cache(len(lengths), ids.shape[1] + n) for _ in range(3)]
            logits = [model(ids.cuda(), c, attention_mask=mask)[:, -1] for c in caches]
            graph = DecodeGraph(model, caches[2])
            for step in range(n):
                tok = logits[0].argmax(-1, keepdim=True)
                first, again = model(tok, caches[0])[:, -1], model(tok, caches[1])[:, -1]
                graphed = graph(tok).clone()
                assert torch.equal(again, first), (scope, lengths, step)
                assert fx.rel(graphed, first) <= tol, (scope, lengths, step, fx.rel(graphed, first))
                logits = [first, again, graphed]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_map_two_gpus_equals_one(artifacts):
    art = artifacts["experts"]
    store = runtime.loader.open_store(art)
    sizes = store_sizes(store, store.config.num_hidden_layers)
    first = sizes.embed + sizes.layers[0] + sizes.layers[1]  # cuda:0 holds embeddings + layers 0-1
    split = runtime.load(
        art, device_map="auto", max_memory={0: first, 1: sizes.total}, dtype=torch.float32, backend="torch"
    )
    n = store.config.num_hidden_layers
    want_devices = (torch.device("cuda", 0),) * 2 + (torch.device("cuda", 1),) * (n - 2)
    assert split.placement.layers == want_devices and split.placement.head == torch.device("cuda", 1)
    assert split.layers[2].self_attn.q_proj.weight.device == torch.device("cuda", 1)
    one = runtime.load(art, device="cuda:0", dtype=torch.float32, backend="torch")
    ids, mask = _left_pad([6, 25])
    a, b = one(ids.cuda(), attention_mask=mask), split(ids.cuda(), attention_mask=mask)
    assert fx.rel(b.cpu(), a.cpu()) <= 1e-5
    want = one.generate(ids.cuda(), 12, attention_mask=mask, cuda_graph=False).cpu()
    assert torch.equal(one.generate(ids.cuda(), 12, attention_mask=mask).cpu(), want)
    assert split.why_no_graph() is None  # one graph per device, the residual handed between them
    assert torch.equal(split.generate(ids.cuda(), 12, attention_mask=mask).cpu(), want)
    assert torch.equal(split.generate(ids.cuda(), 12, attention_mask=mask, cuda_graph=False).cpu(), want)
    with pytest.raises(runtime.PlacementError, match="does not fit"):
        runtime.load(art, device_map="auto", max_memory={0: first, 1: sizes.layers[-1]})
