"""MiniMax-M2 on a CUDA GPU (run with `-m gpu` on the H200; skipped on CPU CI): the runtime on CUDA against
the CPU reference (torch and Triton MoE backends), CUDA-graph decode equal to eager decode, the plain RMSNorm
kernel, a MoE layer at M2's real width through the Triton backend with plain SwiGLU, device_map over two GPUs,
and `porter verify --backend triton --device cuda` on a converted FP8-block checkpoint."""

from __future__ import annotations

import json

import m2_fixtures as fx
import pytest
import torch
from click.testing import CliRunner

import porter
import runtime
from porter.cli import main as cli
from porter.format import mxfp8
from runtime.graph import DecodeGraph
from runtime.models.layers import rms_norm_reference
from runtime.moe import make_moe
from runtime.moe.contract import SIGMOID_BIAS_TOPK, MoeQuantInfo, MoeRouting, make_swiglu_params

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("m2-gpu")
    out = tmp / "m2-mxfp8"
    porter.convert(fx.checkpoint(tmp, "fp8", seed=6), out, progress=False)
    return out


def _left_pad(lengths, seed=1):
    rows = [fx.prompt(n, batch=1, seed=seed + b)[0] for b, n in enumerate(lengths)]
    T = max(lengths)
    ids, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    return ids, mask


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_logits_match_cpu(artifact, backend):
    ids = fx.prompt(40, batch=1, seed=1)
    ref = runtime.load(artifact, device="cpu")(ids)
    out = runtime.load(artifact, device="cuda", dtype=torch.float32, backend=backend)(ids.cuda()).cpu()
    # torch: same math on another device (1e-5); triton: fp16 dequant + bf16 activations in the MoE (1e-2)
    assert fx.rel(out, ref) <= (1e-5 if backend == "torch" else 1e-2), fx.rel(out, ref)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_decode_equals_eager(artifact, backend):
    model = runtime.load(artifact, device="cuda", backend=backend)  # bf16
    assert model.why_no_graph() is None and model.layers[0].self_attn.qkv is not None
    ids, mask = _left_pad([5, 12, 30])
    n = 24
    caches = [model.new_cache(3, ids.shape[1] + n) for _ in range(2)]
    la = model(ids.cuda(), caches[0], attention_mask=mask)[:, -1]
    lb = model(ids.cuda(), caches[1], attention_mask=mask)[:, -1]
    graph = DecodeGraph(model, caches[1])
    for step in range(n):
        tok = la.argmax(-1, keepdim=True)
        assert torch.equal(tok, lb.argmax(-1, keepdim=True)), step
        la, lb = model(tok, caches[0])[:, -1], graph(tok)
        assert fx.rel(lb, la) <= 1e-3, (step, fx.rel(lb, la))  # same kernels; atomics' order may differ
    out_graph = model.generate(ids.cuda(), 16, attention_mask=mask, cuda_graph=True)
    assert torch.equal(out_graph, model.generate(ids.cuda(), 16, attention_mask=mask, cuda_graph=False))


def test_cuda_decode_matches_cpu_step_by_step(artifact):
    """fp32 on both: the decode attention kernel, the router kernels and the GEMVs vs the CPU reference."""
    cpu = runtime.load(artifact, device="cpu", backend="torch")
    gpu = runtime.load(artifact, device="cuda", dtype=torch.float32, backend="torch")
    ids, mask = _left_pad([7, 20])
    cc, gc = cpu.new_cache(2, 40), gpu.new_cache(2, 40)
    lc, lg = cpu(ids, cc, attention_mask=mask)[:, -1], gpu(ids.cuda(), gc, attention_mask=mask)[:, -1]
    assert fx.rel(lg.cpu(), lc) <= 1e-4
    for step in range(16):
        tok = lc.argmax(-1, keepdim=True)
        lc, lg = cpu(tok, cc)[:, -1], gpu(tok.cuda(), gc)[:, -1]
        assert fx.rel(lg.cpu(), lc) <= 1e-4, step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_rms_norm_kernel(dtype):
    """offset 0 (y * w, MiniMax-M2's norm): the kernel == the torch reference, alone and after the add."""
    from runtime.kernels import fused

    g = torch.Generator(device="cuda").manual_seed(3)
    for n in (3072, 6144, 1024):  # hidden, q (48 heads x 128), k (8 x 128)
        w = 1 + 0.1 * torch.randn(n, device="cuda", generator=g, dtype=dtype)
        x, a = (torch.randn(4, 1, n, device="cuda", generator=g, dtype=dtype) * s for s in (30, 1))
        y = fused.rms_norm(x, w, 1e-6, 0.0)
        assert fx.rel(y.float(), rms_norm_reference(x, w, 1e-6, 0.0).float()) <= (
            1e-6 if dtype == torch.float32 else 8e-3
        )
        hout, y2 = fused.add_rms_norm(a, x, w, 1e-6, 0.0)
        assert torch.equal(hout, x + a) and torch.equal(y2, fused.rms_norm(x + a, w, 1e-6, 0.0))


@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
def test_moe_layer_at_real_width_plain_swiglu(tokens):
    """H 3072, I 1536, 32 random MXFP8 experts top-8, plain SwiGLU (alpha 1, beta 0, limit +inf): the Triton
    backend == the torch reference (W8A16) within the bf16 rounding of its activations."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    e, h, i, k = 32, 3072, 1536, 8
    w13, s13 = mxfp8.quantize(torch.randn(e, 2 * i, h, device="cuda", generator=g) * h**-0.5)
    w2, s2 = mxfp8.quantize(torch.randn(e, h, i, device="cuda", generator=g) * i**-0.5)
    quant = MoeQuantInfo(w13, s13, w2, s2, **make_swiglu_params(e, 1.0, 0.0, float("inf"), "cuda"))
    routing = MoeRouting(
        torch.randn(e, h, device="cuda", generator=g) * 0.05,
        torch.randn(e, device="cuda", generator=g) * 0.1,
        k,
        1.0,
        method=SIGMOID_BIAS_TOPK,
    )
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    want = make_moe("torch", quant, routing)(x.float())
    got = make_moe("triton", quant, routing)(x)
    assert fx.rel(got.float(), want) <= 1e-2, fx.rel(got.float(), want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_map_two_gpus_equals_one(artifact):
    from runtime.placement import store_sizes

    store = runtime.loader.open_store(artifact)
    sizes = store_sizes(store, store.config.num_hidden_layers)
    first = sizes.embed + sizes.layers[0]  # cuda:0 holds embeddings + layer 0
    split = runtime.load(
        artifact,
        device_map="auto",
        max_memory={0: first, 1: sizes.total},
        dtype=torch.float32,
        backend="torch",
    )
    assert split.placement.layers[0] == torch.device("cuda", 0) and split.placement.head == torch.device(
        "cuda", 1
    )
    one = runtime.load(artifact, device="cuda:0", dtype=torch.float32, backend="torch")
    ids, mask = _left_pad([6, 25])
    assert (
        fx.rel(split(ids.cuda(), attention_mask=mask).cpu(), one(ids.cuda(), attention_mask=mask).cpu())
        <= 1e-5
    )
    want = one.generate(ids.cuda(), 12, attention_mask=mask, cuda_graph=False).cpu()
    assert torch.equal(split.generate(ids.cuda(), 12, attention_mask=mask).cpu(), want)


def test_verify_triton_on_cuda_passes(artifact, tmp_path):
    report = tmp_path / "r.json"
    res = CliRunner().invoke(
        cli, ["verify", str(artifact), "--backend", "triton", "--device", "cuda", "--report", str(report)]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(report.read_text())
    assert doc["verdict"] == "pass" and doc["passed"] is True
