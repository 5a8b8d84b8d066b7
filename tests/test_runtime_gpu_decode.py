"""Decode on CUDA (run on the H200; skipped without a GPU): CUDA-graph decode equals eager decode, the
Triton decode attention and MXFP8 linear against their references at MiniMax-M3's real dims, the GPU
model against the CPU model step by step, and a device_map split over two GPUs against one GPU."""
from __future__ import annotations

import pytest
import torch

import porter
import runtime
import runtime_fixtures as fx
from porter import mxfp8
from runtime.attention import decode_attention, decode_attention_reference
from runtime.models.minimax_m3 import DecodeGraph
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
    out_eager = model.generate(ids.cuda(), 16, attention_mask=mask)
    assert torch.equal(out_graph, out_eager)


def test_cuda_decode_matches_cpu_step_by_step(artifacts):
    """fp32 on both: Triton decode attention + MXFP8 linears (quantize all) vs the CPU reference path."""
    cpu = runtime.load(artifacts["all"], device="cpu", backend="torch")
    gpu = runtime.load(artifacts["all"], device="cuda", dtype=torch.float32, backend="torch")
    ids, mask = _left_pad([7, 20])
    cc, gc = cpu.new_cache(2, 40), gpu.new_cache(2, 40)
    lc, lg = cpu(ids, cc, attention_mask=mask)[:, -1], gpu(ids.cuda(), gc, attention_mask=mask)[:, -1]
    assert fx.rel(lg.cpu(), lc) <= 1e-4
    for step in range(16):
        tok = lc.argmax(-1, keepdim=True)
        lc, lg = cpu(tok, cc)[:, -1], gpu(tok.cuda(), gc)[:, -1]
        assert fx.rel(lg.cpu(), lc) <= 1e-4, step


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
        pick = lambda p: torch.nn.functional.pad(torch.randperm(p // block + 1, device="cuda")[:topk],
                                                 (0, max(0, topk - (p // block + 1))), value=nblk)
        blocks = torch.stack([torch.stack([pick(p) for _ in range(nkv)]) for p in pos.tolist()])  # [B, nkv, topk]
    want = decode_attention_reference(q.float(), k.float(), v.float(), pos, s_max, blocks, block, d ** -0.5)
    got = decode_attention(q, k, v, pos, s_max, blocks, block, d ** -0.5)
    assert got.dtype == torch.bfloat16
    assert fx.rel(got.float(), want) <= 1e-2


def test_mxfp8_linear_at_real_dims():
    from runtime.mxfp8_linear import applies, mxfp8_linear
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(8192, 6144, device="cuda", generator=g) / 6144 ** 0.5
    q, s = mxfp8.quantize(w)
    for rows in (1, 8, 32):
        x = torch.randn(rows, 6144, device="cuda", generator=g, dtype=torch.bfloat16)
        assert applies(x, q)
        want = x.float() @ mxfp8.dequantize(q, s).t()
        assert fx.rel(mxfp8_linear(x, q, s).float(), want) <= 1e-2
        want32 = x.float() @ mxfp8.dequantize(q, s).t()
        assert fx.rel(mxfp8_linear(x.float(), q, s), want32) <= 1e-5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_map_two_gpus_equals_one(artifacts):
    art = artifacts["experts"]
    store = runtime.loader.open_store(art)
    sizes = store_sizes(store, store.config.num_hidden_layers)
    first = sizes.embed + sizes.layers[0] + sizes.layers[1]  # cuda:0 holds embeddings + layers 0-1
    split = runtime.load(art, device_map="auto", max_memory={0: first, 1: sizes.total}, dtype=torch.float32,
                         backend="torch")
    n = store.config.num_hidden_layers
    want_devices = (torch.device("cuda", 0),) * 2 + (torch.device("cuda", 1),) * (n - 2)
    assert split.placement.layers == want_devices and split.placement.head == torch.device("cuda", 1)
    assert split.layers[2].attn.wq.weight.device == torch.device("cuda", 1)
    one = runtime.load(art, device="cuda:0", dtype=torch.float32, backend="torch")
    ids, mask = _left_pad([6, 25])
    a, b = one(ids.cuda(), attention_mask=mask), split(ids.cuda(), attention_mask=mask)
    assert fx.rel(b.cpu(), a.cpu()) <= 1e-5
    assert torch.equal(one.generate(ids.cuda(), 12, attention_mask=mask).cpu(),
                       split.generate(ids.cuda(), 12, attention_mask=mask).cpu())
    with pytest.raises(runtime.PlacementError, match="does not fit"):
        runtime.load(art, device_map="auto", max_memory={0: first, 1: sizes.layers[-1]})
