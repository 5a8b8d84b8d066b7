"""CPU contract of the fused decode step's building blocks (the kernels themselves are checked on the GPU in
tests/test_runtime_gpu_decode.py): stacked linears keep one copy of each weight, and the `add` arguments
(residual adds folded into a GEMV epilogue on CUDA) give what the unfused layer computes."""

from __future__ import annotations

import torch

from porter.format import mxfp8
from runtime.kernels import fused
from runtime.models import layers
from runtime.models import minimax_m3 as m3


def test_stack_linears_keeps_one_copy(monkeypatch):
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 64, generator=g).bfloat16() for n in (48, 16, 16)]
    parts = [layers.Linear(w.clone()) for w in ws]
    monkeypatch.setattr(fused, "use_triton", lambda t: True)  # stacking happens for weights a kernel reads
    stacked = layers.stack_linears(*parts)
    assert stacked.weight.shape == (80, 64) and stacked.scale is None
    base = stacked.weight.untyped_storage().data_ptr()
    row = 0
    for p, w in zip(parts, ws):
        assert p.weight.untyped_storage().data_ptr() == base  # a view: no second copy
        assert p.weight.is_contiguous() and torch.equal(p.weight, w)
        assert torch.equal(stacked.weight[row : row + w.shape[0]], w)
        row += w.shape[0]


def test_stack_linears_stacks_mxfp8_scales_and_refuses_mixes(monkeypatch):
    g = torch.Generator().manual_seed(1)
    qs = [mxfp8.quantize(torch.randn(n, 64, generator=g)) for n in (32, 8)]
    monkeypatch.setattr(fused, "use_triton", lambda t: True)
    parts = [layers.Linear(q, s) for q, s in qs]
    stacked = layers.stack_linears(*parts)
    assert stacked.scale.shape == (40, 2) and torch.equal(stacked.scale[32:], qs[1][1])
    assert torch.equal(parts[1].weight.view(torch.uint8), qs[1][0].view(torch.uint8))
    mixed = [
        layers.Linear(torch.zeros(8, 64, dtype=torch.bfloat16)),
        layers.Linear(*mxfp8.quantize(torch.ones(8, 64))),
    ]
    assert layers.stack_linears(*mixed) is None  # bf16 + MXFP8 cannot share one kernel
    monkeypatch.setattr(fused, "use_triton", lambda t: False)
    assert (
        layers.stack_linears(layers.Linear(torch.zeros(8, 64)), layers.Linear(torch.zeros(8, 64))) is None
    )  # CPU: as loaded


def test_linear_and_mlp_adds_equal_adding_after(tiny_vendor):
    """Linear(x, add=(a, b)) == (Linear(x) + a) + b; the dense MLP and the MoE block with add=(h,) == h + block(x),
    bit for bit in bf16 (the CPU reference path; on CUDA the same adds run in the GEMV epilogue)."""
    import runtime

    g = torch.Generator().manual_seed(2)
    lin = layers.Linear(torch.randn(32, 64, generator=g).bfloat16())
    x = torch.randn(3, 64, generator=g).bfloat16()
    a, b = torch.randn(3, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16()
    assert torch.equal(lin(x, add=(a, b)), (lin(x) + a) + b)
    model = runtime.load(tiny_vendor, device="cpu", dtype=torch.bfloat16, backend="torch")
    H = model.cfg.hidden_size
    x, h = torch.randn(2, 3, H, generator=g).bfloat16(), torch.randn(2, 3, H, generator=g).bfloat16()
    for i in (0, 1):  # layer 0: dense MLP; layer 1: MoE with a shared expert
        mlp = model.layers[i].mlp
        assert isinstance(mlp, m3.MoE) == (i == 1)
        assert torch.equal(mlp(x, add=(h,)), h + mlp(x))
