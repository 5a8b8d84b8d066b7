"""Runtime logits == transformers 5.23's MiniMaxM2ForCausalLM (the independent oracle) on tiny random MiniMax-M2
checkpoints, with the bounds of the MiniMax-M3 oracle tests (tests/test_runtime_oracle.py).

Sources: the bf16 release layout (transformers loads it with its own conversion mapping), transformers' fused
in-memory names, and the FP8-block release (the oracle gets its weights dequantized by the release's formula,
tests/m2_fixtures.py). Run from the original checkpoint and from the porter artifact (`--quantize none`
exact to fp32 round-off; MXFP8 against transformers with the same weights fake-quantized by
porter.format.mxfp8), with the residual stream compared layer by layer, left-padded batches and the decode
path over a cache.
"""

from __future__ import annotations

import m2_fixtures as fx
import pytest
import torch

pytest.importorskip("transformers")

import runtime  # noqa: E402
from porter import convert  # noqa: E402

EXACT, MXFP8_TOL = 1e-5, 2e-3
SHORT, LONG = 6, 40


@pytest.fixture(scope="module")
def oracles(tmp_path_factory):
    """layout -> (source dir, its weights as the oracle reads them, the oracle)."""
    from minimax_m2_tiny_checkpoint import config
    from transformers import MiniMaxM2ForCausalLM

    tmp = tmp_path_factory.mktemp("m2-oracle")
    out = {}
    vendor = fx.checkpoint(tmp, "vendor", seed=3)
    hf, info = MiniMaxM2ForCausalLM.from_pretrained(
        str(vendor), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"]  # only the MTP stand-ins are unexpected
    assert {k.split(".")[2] for k in info["unexpected_keys"]} == {"3"}
    out["vendor"] = (vendor, fx.read_all(vendor), hf.eval())
    fused = fx.checkpoint(tmp, "transformers", seed=5)
    cfg = config()
    weights = fx.read_all(fx.checkpoint(tmp, "vendor", seed=5))  # the same weights under release names
    out["transformers"] = (fused, weights, fx.hf_model(weights, cfg))
    fp8 = fx.checkpoint(tmp, "fp8", seed=4)
    deq = fx.dequantize_release(fx.read_all(fp8))
    out["fp8"] = (fp8, deq, fx.hf_model(deq, cfg))
    return out


def _artifact(src, quantize, tmp):
    out = tmp / f"{src.name}-{quantize}"
    if not out.exists():
        convert(src, out, quantize=quantize, progress=False)
    return out


@pytest.mark.parametrize("n", [SHORT, LONG])
@pytest.mark.parametrize("layout", ["vendor", "transformers", "fp8"])
def test_unquantized_matches_transformers(oracles, layout, n, tmp_path_factory):
    src, _, hf = oracles[layout]
    ids = fx.prompt(n)
    want = fx.hf_logits(hf, ids)
    for path in (src, _artifact(src, "none", tmp_path_factory.getbasetemp())):
        got = runtime.load(path, device="cpu", dtype=torch.float32)(ids)
        assert got.shape == want.shape and got.dtype == torch.float32
        err = fx.rel(got, want)
        print(f"{layout} {path.name} T={n}: rel {err:.2e}")
        assert err <= EXACT, (layout, path.name, n, err)


@pytest.mark.parametrize("scope", ["experts", "all"])
@pytest.mark.parametrize("layout", ["transformers", "fp8"])
def test_mxfp8_matches_fake_quantized_transformers(oracles, layout, scope, tmp_path_factory):
    from minimax_m2_tiny_checkpoint import config

    src, weights, hf = oracles[layout]
    ids = fx.prompt(LONG, seed=11)
    plain = fx.hf_logits(hf, ids)
    want = fx.hf_logits(fx.hf_model(fx.fake_quantize_experts(weights, scope), config()), ids)
    model = runtime.load(
        _artifact(src, scope, tmp_path_factory.getbasetemp()),
        device="cpu",
        dtype=torch.float32,
        backend="torch",
    )
    moe = model.layers[1].mlp
    assert (
        moe.quant.w13_weight.dtype == torch.float8_e4m3fn and moe.quant.w13_weight_scale.dtype == torch.uint8
    )
    assert torch.equal(moe.quant.gemm1_clamp_limit, torch.full((8,), float("inf")))  # plain SwiGLU, no clamp
    assert torch.equal(moe.quant.gemm1_alpha, torch.ones(8)) and torch.equal(
        moe.quant.gemm1_beta, torch.zeros(8)
    )
    if scope == "all":
        assert model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    got = model(ids)
    err, quant_effect = fx.rel(got, want), fx.rel(want, plain)
    print(f"{layout} mxfp8-{scope}: rel {err:.2e} (quantization itself moves logits by {quant_effect:.2e})")
    assert err <= MXFP8_TOL, err
    assert err < quant_effect  # the comparison is sharp enough to see the quantization


def test_hidden_states_match_transformers_layer_by_layer(oracles):
    src, _, hf = oracles["fp8"]
    ids = fx.prompt(LONG, seed=13)
    want = fx.hf_hidden_states(hf, ids)
    model = runtime.load(src, device="cpu")
    logits, states = model(ids, output_hidden_states=True)
    assert len(states) == len(want) == model.cfg.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(states[:-1], want[:-1])):  # transformers' last entry is final-normed
        assert fx.rel(a, b) <= EXACT, (i, fx.rel(a, b))
    lazy = runtime.load(src, device="cpu", lazy=True)  # one layer at a time, from the HF residual stream
    pos = torch.arange(ids.shape[1])
    for i in range(len(lazy.layers)):
        assert fx.rel(lazy.layers[i](want[i].float(), pos), states[i + 1]) <= EXACT, i
    assert fx.rel(lazy.final(states[-1]), logits) <= EXACT


def test_padded_batch_and_cached_decode_match_transformers(oracles):
    """Left-padded prompts of different lengths give each row's own logits (transformers with its attention
    mask), and greedy decoding over porter's cache equals transformers' greedy generate."""
    src, _, hf = oracles["vendor"]
    model = runtime.load(src, device="cpu", dtype=torch.float32)
    rows = [fx.prompt(n, batch=1, seed=20 + n)[0] for n in (5, 17)]
    T = max(len(r) for r in rows)
    ids = torch.zeros(2, T, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    got = model(ids, attention_mask=mask)
    for b, r in enumerate(rows):
        alone = fx.hf_logits(hf, r[None])
        assert fx.rel(got[b, T - len(r) :], alone[0]) <= EXACT, b
    prompt = fx.prompt(9, batch=1, seed=31)
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(model.generate(prompt, 8, eos_token_id=None), want)
