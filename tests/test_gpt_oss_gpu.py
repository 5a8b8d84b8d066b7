"""gpt-oss on a CUDA GPU (run with `-m gpu` on the H200; skipped on CPU CI): the runtime on CUDA against the
CPU reference (torch and Triton MoE backends with expert biases), and CUDA-graph decode (sinks, the sliding
window gathered by position) equal to eager decode, past the window, with left-padded rows."""

from __future__ import annotations

import pytest
import torch
from gpt_oss_tiny_checkpoint import TINY, build_tiny_checkpoint

import porter
import runtime
from runtime.graph import DecodeGraph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gptoss-gpu")
    out = tmp / "mxfp8"
    porter.convert(build_tiny_checkpoint(tmp / "src", "mxfp4", seed=31), out, progress=False)
    return out


def _left_pad(lengths):
    rows = [prompt(n, seed=b) for b, n in enumerate(lengths)]
    T = max(lengths)
    ids, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    return ids, mask


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_logits_match_cpu(artifact, backend):
    ids = prompt(24, seed=5)[None]
    ref = runtime.load(artifact, device="cpu")(ids)
    out = runtime.load(artifact, device="cuda", dtype=torch.float32, backend=backend)(ids.cuda()).cpu()
    # torch: the same math on another device; triton: its own MoE numerics (bf16 / fp16 operands)
    assert rel(out, ref) <= (1e-5 if backend == "torch" else 1e-2), rel(out, ref)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graph_decode_equals_eager(artifact, backend):
    model = runtime.load(artifact, device="cuda", backend=backend)  # bf16
    assert model.why_no_graph() is None
    ids, mask = _left_pad([3, 9, 14])  # the window is 4: every row decodes past it
    n = 20
    caches = [model.new_cache(3, ids.shape[1] + n) for _ in range(2)]
    la = model(ids.cuda(), caches[0], attention_mask=mask)[:, -1]
    lb = model(ids.cuda(), caches[1], attention_mask=mask)[:, -1]
    graph = DecodeGraph(model, caches[1])
    for step in range(n):
        tok = la.argmax(-1, keepdim=True)
        assert torch.equal(tok, lb.argmax(-1, keepdim=True)), step
        la, lb = model(tok, caches[0])[:, -1], graph(tok)
        assert rel(lb, la) <= 1e-3, (step, rel(lb, la))
    out_graph = model.generate(ids.cuda(), 12, attention_mask=mask, cuda_graph=True, eos_token_id=[])
    out_eager = model.generate(ids.cuda(), 12, attention_mask=mask, cuda_graph=False, eos_token_id=[])
    assert torch.equal(out_graph, out_eager)
