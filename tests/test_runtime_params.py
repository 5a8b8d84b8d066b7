"""The SwiGLU-OAI parameter chain (config.json -> resolved config -> per-expert [E] tensors -> math),
generate with the KV cache vs full recomputation, layer streaming, and the backend guard on CPU."""

from __future__ import annotations

import json

import pytest
import runtime_fixtures as fx
import torch

import runtime
from porter import convert
from porter.format import mxfp8
from runtime.moe import BackendUnavailable

CUSTOM = {"swiglu_alpha": 1.25, "swiglu_beta": 0.375, "swiglu_limit": 2.5}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("params")
    default = fx.vendor_checkpoint(base / "default", seed=9)
    custom = fx.vendor_checkpoint(base / "custom", seed=9, text_overrides=CUSTOM)
    art = base / "custom-mxfp8"
    convert(custom, art, quantize="experts", progress=False)
    return default, custom, art


def _direct_swiglu(gate, up, alpha, beta, limit):
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    return g * torch.sigmoid(alpha * g) * (u + beta)


def _direct_moe(moe, x):
    """The MoE block written out from the resolved config, independent of the backend."""
    cfg, (w13, w2) = moe.cfg, _expert_weights(moe.quant)
    logits = x @ moe.routing.router_weight.t()  # [T, E]
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + moe.routing.e_score_correction_bias, cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    i = cfg.intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gu = w13[e] @ x[t]
            act = _direct_swiglu(gu[:i], gu[i:], cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit)
            out[t] += w[t, slot] * (w2[e] @ act)
    sh = moe.shared_experts
    shared = sh.down_proj.weight.float() @ _direct_swiglu(
        sh.gate_proj.weight.float() @ x.t(),
        sh.up_proj.weight.float() @ x.t(),
        cfg.swiglu_alpha,
        cfg.swiglu_beta,
        cfg.swiglu_limit,
    )
    return cfg.routed_scaling_factor * out + shared.t()


def _expert_weights(q):
    if q.is_mxfp8:
        return mxfp8.dequantize(q.w13_weight, q.w13_weight_scale), mxfp8.dequantize(
            q.w2_weight, q.w2_weight_scale
        )
    return q.w13_weight.float(), q.w2_weight.float()


def test_config_values_reach_resolved_config_and_expert_tensors(ckpts):
    default, custom, art = ckpts
    raw = json.loads((custom / "config.json").read_text())
    assert {k: raw["text_config"][k] for k in CUSTOM} == CUSTOM
    for path in (custom, art):
        model = runtime.load(path, device="cpu")
        for k, v in CUSTOM.items():
            assert getattr(model.cfg, k) == v
            assert model.cfg.provenance[k].startswith("config:"), model.cfg.provenance[k]
        moes = [l.mlp for l in model.layers if hasattr(l.mlp, "quant")]
        assert len(moes) == 3
        for moe in moes:
            for name, key in (
                ("gemm1_alpha", "swiglu_alpha"),
                ("gemm1_beta", "swiglu_beta"),
                ("gemm1_clamp_limit", "swiglu_limit"),
            ):
                t = getattr(moe.quant, name)
                assert t.shape == (model.cfg.num_local_experts,) and t.dtype == torch.float32
                assert t.device == moe.quant.w13_weight.device == torch.device("cpu")
                assert torch.equal(t, torch.full_like(t, CUSTOM[key]))


def test_missing_beta_becomes_one(ckpts):
    default, _, _ = ckpts
    assert "swiglu_beta" not in json.loads((default / "config.json").read_text())["text_config"]
    model = runtime.load(default, device="cpu")
    assert model.cfg.swiglu_beta == 1.0 and model.cfg.provenance["swiglu_beta"] == "default"
    for layer in model.layers:
        if hasattr(layer.mlp, "quant"):
            assert torch.equal(layer.mlp.quant.gemm1_beta, torch.ones(model.cfg.num_local_experts))


@pytest.mark.parametrize("which", ["source", "artifact"])
def test_custom_params_change_the_math_and_match_direct_computation(ckpts, which):
    default, custom, art = ckpts
    model = runtime.load(custom if which == "source" else art, device="cpu")
    base = runtime.load(default, device="cpu")
    x = 2.0 * torch.randn(12, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    layer = next(l for l in model.layers if hasattr(l.mlp, "quant"))
    got = layer.mlp(x)
    want = _direct_moe(layer.mlp, x)
    assert fx.rel(got, want) < 1e-5
    # the limit really clamps on this input, and the defaults give a different answer on the same weights
    assert float((x @ _expert_weights(layer.mlp.quant)[0][0].t()).abs().max()) > CUSTOM["swiglu_limit"]
    same_weights = next(l for l in base.layers if hasattr(l.mlp, "quant")).mlp
    assert fx.rel(same_weights(x), got) > 1e-2
    # dense MLP (layer 0) uses the same alpha/beta/limit
    mlp = model.layers[0].mlp
    direct = mlp.down_proj.weight.float() @ _direct_swiglu(
        mlp.gate_proj.weight.float() @ x.t(),
        mlp.up_proj.weight.float() @ x.t(),
        CUSTOM["swiglu_alpha"],
        CUSTOM["swiglu_beta"],
        CUSTOM["swiglu_limit"],
    )
    assert fx.rel(mlp(x), direct.t()) < 1e-5


def test_generate_with_cache_equals_full_recomputation(ckpts):
    default, _, _ = ckpts
    model = runtime.load(default, device="cpu")
    ids = fx.prompt(5, batch=2, seed=3)
    n_new = 3 * fx.THRESHOLD  # 5 + 24 tokens: crosses the dense/sparse threshold (8 keys)
    out = model.generate(ids, max_new_tokens=n_new)
    assert out.shape == (2, 5 + n_new) and torch.equal(out[:, :5], ids)
    cache = model.new_cache(2, 5 + n_new)
    logits = model(ids, cache)
    excluded = 0
    for step in range(n_new):
        seq = out[:, : 5 + step]
        full = model(seq)  # no cache
        assert fx.rel(logits[:, -1], full[:, -1]) < 1e-5, step
        assert torch.equal(full[:, -1].argmax(-1), out[:, 5 + step]), step
        logits = model(out[:, 5 + step : 6 + step], cache)  # one token through the KV + indexer key cache
        excluded += sum(
            l.self_attn.indexer.last_excluded for l in model.layers if l.self_attn.indexer is not None
        )
    assert excluded > 0  # decoding steps past the threshold really ran sparse
    assert cache.length == 5 + n_new


def test_lazy_layer_streaming_matches_eager(ckpts):
    default, _, _ = ckpts
    eager = runtime.load(default, device="cpu")
    lazy = runtime.load(default, device="cpu", lazy=True)
    ids = fx.prompt(fx.LONG, seed=4)
    assert torch.equal(eager(ids), lazy(ids))
    first = lazy.layers[0]
    assert lazy.layers[0] is first  # resident until another layer is asked for
    lazy.layers[1]
    assert lazy.layers._index == 1 and lazy.layers[0] is not first  # rebuilt: one layer at a time
    lazy.layers.release()
    assert lazy.layers._layer is None


def test_trtllm_backend_on_cpu_is_a_clear_error(ckpts):
    _, _, art = ckpts
    with pytest.raises(BackendUnavailable) as err:
        runtime.load(art, device="cpu", backend="flashinfer-trtllm")
    msg = str(err.value)
    assert "\n" not in msg and "cpu" in msg.lower(), msg
    with pytest.raises(BackendUnavailable, match="unknown MoE backend"):
        runtime.load(art, device="cpu", backend="cutlass")


def test_auto_backend_on_cpu_is_torch(ckpts, caplog):
    _, _, art = ckpts
    with caplog.at_level("INFO", logger="porter.runtime"):
        model = runtime.load(art, device="cpu")
    assert "MoE backend: torch" in caplog.text
    assert type(next(l for l in model.layers if hasattr(l.mlp, "quant")).mlp.experts).__name__ == "TorchMoE"


def test_interrupted_artifact_is_refused(tmp_path, tiny_vendor):
    """No index (porter writes it last) means an unfinished conversion: load must not treat it as complete."""
    import runtime
    from porter import convert

    art = tmp_path / "art"
    convert(tiny_vendor, art, progress=False)
    (art / "model.safetensors.index.json").unlink()
    with pytest.raises(runtime.LoadError, match="did not finish.*--resume"):
        runtime.load(art)


def test_moe_layer_holds_the_expert_tensors_only_through_its_backend(ckpts):
    """A backend that keeps the canonical tensors (torch) leaves them reachable as layer.quant; one that
    makes its own layout at load and keeps none (TRT-LLM, the Triton rebase) leaves the layer none either,
    so the experts are not resident twice."""
    from runtime.loader import getter, open_store
    from runtime.models.minimax_m3 import MoE
    from runtime.moe import make_moe

    _, _, art = ckpts
    store = open_store(art)
    layer = next(i for i in range(store.config.num_hidden_layers) if store.config.is_moe(i))
    get = getter(store, store.names(), torch.device("cpu"))
    prefix = f"model.layers.{layer}.block_sparse_moe."
    torch_layer = MoE(store.config, get, prefix, torch.device("cpu"), lambda q, r: make_moe("torch", q, r))
    assert torch_layer.quant is torch_layer.experts.quant
    assert torch_layer.quant.w13_weight.dtype == torch.float8_e4m3fn

    class OwnLayout:  # what TrtllmMoE keeps: derived tensors, no MoeQuantInfo
        def __init__(self, q, r):
            self.gemm1_weights = q.w13_weight.clone()

    own = MoE(store.config, get, prefix, torch.device("cpu"), OwnLayout)
    assert own.quant is None and own.experts.gemm1_weights.shape == torch_layer.quant.w13_weight.shape
