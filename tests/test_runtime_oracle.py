"""Runtime logits == transformers 5.23 (the independent oracle) on tiny random MiniMax-M3 checkpoints.

Both source layouts (vendor names + legacy config keys; transformers' own fused save_pretrained), run from
the original checkpoint and from the porter artifact (`--quantize none` exact to fp32 round-off; MXFP8
against transformers with the same weights fake-quantized by porter.format.mxfp8), with prompts below the
sparse-attention threshold (topk*block = 8 keys) and 5x above it, where the indexer must drop blocks.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import runtime_fixtures as fx  # noqa: E402

import runtime  # noqa: E402
from porter import convert  # noqa: E402

EXACT, MXFP8_TOL = 1e-5, 2e-3


@pytest.fixture(scope="module")
def vendor(tmp_path_factory):
    d = fx.vendor_checkpoint(tmp_path_factory.mktemp("vendor") / "src", seed=3)
    return d, fx.hf_vendor_model(d)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return fx.hf_transformers_checkpoint(tmp_path_factory.mktemp("fused") / "src", seed=5)


def _artifact(src, quantize, tmp):
    out = tmp / f"artifact-{quantize}"
    if not out.exists():
        convert(src, out, quantize=quantize, progress=False)
    return out


def _check_sparse_selected(model):
    """On the long prompt every sparse layer must really have dropped visible blocks."""
    excluded = [
        layer.self_attn.indexer.last_excluded for layer in model.layers if layer.self_attn.indexer is not None
    ]
    assert excluded and all(e > 0 for e in excluded), excluded


@pytest.mark.parametrize("n", [fx.SHORT, fx.LONG])
@pytest.mark.parametrize("layout", ["vendor", "fused"])
def test_unquantized_matches_transformers(layout, n, request, tmp_path_factory):
    src, hf = request.getfixturevalue(layout)
    ids = fx.prompt(n)
    want = fx.hf_logits(hf, ids)
    tmp = tmp_path_factory.getbasetemp() / f"{layout}-artifacts"
    tmp.mkdir(exist_ok=True)
    for path in (src, _artifact(src, "none", tmp)):
        model = runtime.load(path, device="cpu", dtype=torch.float32)
        got = model(ids)
        assert got.shape == want.shape and got.dtype == torch.float32
        err = fx.rel(got, want)
        print(f"{layout} {path.name} T={n}: rel {err:.2e}")
        assert err <= EXACT, (layout, path.name, n, err)
        if n > fx.THRESHOLD:
            _check_sparse_selected(model)
        else:
            assert all(
                l.self_attn.indexer is None or l.self_attn.indexer.last_excluded == 0 for l in model.layers
            )


@pytest.mark.parametrize("scope", ["experts", "all"])
@pytest.mark.parametrize("layout", ["vendor", "fused"])
def test_mxfp8_matches_fake_quantized_transformers(layout, scope, request, tmp_path_factory):
    src, hf = request.getfixturevalue(layout)
    ids = fx.prompt(fx.LONG, seed=11)
    plain = fx.hf_logits(hf, ids)
    import copy

    ref = fx.fake_quantize_hf(copy.deepcopy(hf), scope)
    want = fx.hf_logits(ref, ids)
    tmp = tmp_path_factory.getbasetemp() / f"{layout}-artifacts"
    tmp.mkdir(exist_ok=True)
    model = runtime.load(_artifact(src, scope, tmp), device="cpu", dtype=torch.float32, backend="torch")
    moe = next(l.mlp for l in model.layers if hasattr(l.mlp, "quant"))
    assert (
        moe.quant.w13_weight.dtype == torch.float8_e4m3fn and moe.quant.w13_weight_scale.dtype == torch.uint8
    )
    if scope == "all":
        assert model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn  # dequantized on the fly
    got = model(ids)
    err, quant_effect = fx.rel(got, want), fx.rel(want, plain)
    print(f"{layout} mxfp8-{scope}: rel {err:.2e} (quantization itself moves logits by {quant_effect:.2e})")
    assert err <= MXFP8_TOL, err
    assert err < quant_effect  # the comparison is sharp enough to see the quantization
    _check_sparse_selected(model)


def test_hidden_states_match_transformers_layer_by_layer(fused):
    src, hf = fused
    ids = fx.prompt(fx.LONG, seed=13)
    want = fx.hf_hidden_states(hf, ids)
    model = runtime.load(src, device="cpu")
    logits, states = model(ids, output_hidden_states=True)
    assert len(states) == len(want) == model.cfg.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(states[:-1], want[:-1])):  # transformers' last entry is final-normed
        assert fx.rel(a, b) <= EXACT, (i, fx.rel(a, b))
    # one layer at a time, layer-streaming, from the HF residual stream: same per-layer outputs
    lazy = runtime.load(src, device="cpu", lazy=True)
    pos = torch.arange(ids.shape[1])
    for i in range(len(lazy.layers)):
        out = lazy.layers[i](want[i].float(), pos)
        assert fx.rel(out, states[i + 1]) <= EXACT, i
    assert fx.rel(lazy.final(states[-1]), logits) <= EXACT
