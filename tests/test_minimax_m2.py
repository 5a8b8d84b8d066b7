"""The MiniMax-M2 converter: config resolution with provenance (each default, each legacy key, bad values
named), the activation resolved per family (plain SwiGLU, never MiniMax-M3's SwiGLU-OAI defaults), conversion
of the FP8-block release, its bf16 and transformers-fused layouts (bytes, shapes, the re-quantization error
recorded per tensor), the MTP layers carried, the hf layout, `porter inspect`, and `porter verify` passing on
a converted M2 and exiting 1 on a planted layout bug."""

from __future__ import annotations

import dataclasses
import json
import math

import m2_fixtures as fx
import pytest
import torch
from click.testing import CliRunner
from minimax_m2_tiny_checkpoint import config, transformers_config

import converters
import converters.minimax_m2 as m2
import porter
from porter.cli import main as cli
from porter.errors import ConfigError, LayoutError
from porter.format import mxfp8

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

W13 = "model.layers.{}.block_sparse_moe.experts.w13_weight"
W2 = "model.layers.{}.block_sparse_moe.experts.w2_weight"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("m2-src")
    return {layout: fx.checkpoint(tmp, layout) for layout in ("fp8", "vendor", "transformers")}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("m2-art")
    out = {}
    for layout, src in sources.items():
        out[layout] = tmp / f"{layout}-mxfp8"
        porter.convert(src, out[layout], progress=False)
    out["fp8-hf"] = tmp / "fp8-hf"
    porter.convert(sources["fp8"], out["fp8-hf"], layout="hf", progress=False)
    return out


# ---------------------------------------------------------------------------------------------------
# config resolution
# ---------------------------------------------------------------------------------------------------


def test_registry_and_protocol():
    assert converters.get("minimax_m2") is m2
    assert converters.base.conformance_problems(m2) == []
    assert m2.ARCHITECTURE == "minimax_m2" and m2.LAYOUTS == ("porter", "hf")
    assert m2.DEFAULT_SCOPE == {"porter": "experts", "hf": "all"}


def test_defaults_are_the_release_values():
    cfg = m2.resolve_config({"model_type": "minimax_m2"})
    want = dict(
        vocab_size=200064,
        hidden_size=3072,
        num_hidden_layers=62,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=1536,
        num_local_experts=256,
        num_experts_per_tok=8,
        rms_norm_eps=1e-6,
        rope_theta=5e6,
        rotary_dim=128,  # no rotary_dim nor partial_rotary_factor: full width, as transformers
        max_position_embeddings=196608,
        hidden_act="silu",
        use_routing_bias=True,
        num_mtp_modules=0,
        bos_token_id=200034,
        eos_token_id=200020,
    )
    assert {k: getattr(cfg, k) for k in want} == want
    assert all(cfg.provenance[k].startswith("default") for k in want)
    assert (cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit, cfg.routed_scaling_factor) == (
        1.0,
        0.0,
        math.inf,
        1.0,
    )


def test_release_config_keys_resolve_with_provenance():
    raw = config({"num_experts": 16}, bos=1, eos=2)
    raw.pop("num_local_experts")
    cfg = m2.resolve_config(raw)
    assert cfg.num_local_experts == 16 and cfg.provenance["num_local_experts"] == "legacy:num_experts"
    assert cfg.rotary_dim == 32 and cfg.provenance["rotary_dim"] == "legacy:rotary_dim"
    assert cfg.rope_theta == 5e6 and cfg.provenance["rope_theta"] == "legacy:rope_theta"
    assert cfg.num_mtp_modules == 1 and cfg.provenance["num_mtp_modules"] == "config:num_mtp_modules"
    flat = m2.resolve_config(transformers_config(config()))
    assert flat.rotary_dim == 32
    assert flat.provenance["rotary_dim"] == "config:rope_parameters.partial_rotary_factor"
    assert flat.provenance["rope_theta"] == "config:rope_parameters.rope_theta"
    assert m2.resolve_config(config({"use_mtp": False})).num_mtp_modules == 0


@pytest.mark.parametrize(
    "override, message",
    [
        ({"hidden_act": "gelu"}, r"'hidden_act' = 'gelu' is not supported: .* needs 'silu' \(plain SwiGLU\)"),
        ({"scoring_func": "softmax"}, r"'scoring_func' = 'softmax' is not supported"),
        ({"qk_norm_type": "per_head"}, r"'qk_norm_type' = 'per_head' is not supported"),
        ({"shared_intermediate_size": 1536}, r"'shared_intermediate_size' = 1536 is not supported"),
        ({"attn_type_list": [1, 0, 1]}, r"'attn_type_list' must be 3 x 1"),
        ({"rope_parameters": {"rope_type": "yarn"}}, r"only plain RoPE is supported"),
        (
            {"rope_parameters": {"partial_rotary_factor": 1.0}},
            r"disagree on the rotary width: rotary_dim -> 32, rope_parameters.partial_rotary_factor -> 64",
        ),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok must not exceed num_local_experts"),
        ({"hidden_size": "256"}, r"config field 'hidden_size' must be an integer, got '256'"),
        ({"rotary_dim": 65}, r"rotary_dim must be even and in \(0, head_dim\]"),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        m2.resolve_config(config(override))


def test_activation_is_resolved_per_family():
    """M2 records plain SwiGLU, from its hidden_act; M3 keeps its SwiGLU-OAI values with their own provenance:
    neither family's values leak into the other."""
    facts = m2.manifest_facts(m2.resolve_config(config()))
    assert facts["activation"] == {
        "name": "swiglu",
        "formula": "silu(g) * u",
        "alpha": 1.0,
        "beta": 0.0,
        "limit": None,
        "provenance": {
            "name": "config:hidden_act",
            "alpha": "implied by hidden_act 'silu' (plain SwiGLU)",
            "beta": "implied by hidden_act 'silu' (plain SwiGLU)",
            "limit": "implied by hidden_act 'silu' (plain SwiGLU)",
        },
    }
    assert 1.702 not in facts["activation"].values() and 7.0 not in facts["activation"].values()
    assert facts["mtp"]["modules"] == 1
    from tiny_checkpoint import vendor_config

    m3 = converters.get("minimax_m3_vl")
    m3_act = m3.manifest_facts(m3.resolve_config(vendor_config()))["activation"]
    assert (m3_act["name"], m3_act["alpha"], m3_act["beta"], m3_act["limit"]) == (
        "swiglu_oai",
        1.702,
        1.0,
        7.0,
    )


# ---------------------------------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------------------------------


def test_bf16_layouts_give_identical_bytes(converted):
    """The release's names and transformers' fused names of the same weights convert to the same bytes."""
    a, b = fx.read_all(converted["vendor"]), fx.read_all(converted["transformers"])
    assert set(a) - set(b) == {n for n in a if n.startswith("model.layers.3.")}  # MTP: not in transformers'
    for name in b:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    for layer in range(3):
        assert (
            a[W13.format(layer)].shape == (8, 256, 256) and a[W13.format(layer)].dtype == torch.float8_e4m3fn
        )
        assert a[W2.format(layer)].shape == (8, 256, 128)
        assert a[W13.format(layer) + "_scale"].shape == (8, 256, 8)


def test_fp8_release_requantized_and_its_error_recorded(sources, converted):
    """Each MXFP8 expert of the FP8-block source equals porter.format.mxfp8.quantize of the release's weights
    dequantized by the release's formula (written in the test), [w1; w3] stacked; porter.json records the
    re-quantization error of each tensor against those dequantized weights."""
    src = fx.dequantize_release(fx.read_all(sources["fp8"]))
    out = fx.read_all(converted["fp8"])
    man = json.loads((converted["fp8"] / "porter.json").read_text())
    assert man["options"]["source_quantization"] == {
        "method": "fp8-block",
        "weight_block_size": [128, 128],
        "dequantized_dtype": "bfloat16",
        "scale_bytes": "rederived",
    }
    for layer in range(3):
        m = f"model.layers.{layer}.block_sparse_moe.experts."
        w13 = torch.stack(
            [torch.cat([src[m + f"{e}.w1.weight"], src[m + f"{e}.w3.weight"]]) for e in range(8)]
        )
        q, s = mxfp8.quantize(w13)
        assert torch.equal(out[W13.format(layer)].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(out[W13.format(layer) + "_scale"], s)
        err = fx.rel(mxfp8.dequantize(q, s), w13)
        rec = man["tensors"][W13.format(layer)]
        assert rec["source_dtype"] == "bfloat16" and math.isclose(rec["rel_fro_error"], err, rel_tol=1e-4)
        assert 0.005 < err < 0.0625  # FP8-block -> MXFP8 is lossy: other block shape, power-of-two scales
    # attention stays at its dequantized bf16 values with --quantize experts
    name = "model.layers.1.self_attn.q_proj.weight"
    assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], src[name])


def test_mtp_layers_are_carried(sources, converted):
    src, out = fx.read_all(sources["vendor"]), fx.read_all(converted["vendor"])
    mtp = sorted(n for n in src if n.startswith("model.layers.3."))
    assert mtp == [
        "model.layers.3.eh_proj.weight",
        "model.layers.3.enorm.weight",
        "model.layers.3.hnorm.weight",
    ]
    assert all(torch.equal(out[n], src[n]) for n in mtp)
    man = json.loads((converted["vendor"] / "porter.json").read_text())
    assert man["mtp"] == {
        "modules": 1,
        "handling": "carried under their source names as read (not run by porter's runtime)",
    }
    cfg = m2.resolve_config(config())
    meta = {n: (t.dtype, tuple(t.shape)) for n, t in src.items()}
    meta["model.layers.4.enorm.weight"] = (torch.bfloat16, (256,))  # past the one MTP module
    with pytest.raises(LayoutError, match=r"layer 4 exceeds num_hidden_layers=3 \+ num_mtp_modules=1"):
        m2.plan_tensors(cfg, meta)


def test_plan_refuses_a_checkpoint_that_is_not_the_config(sources):
    cfg = m2.resolve_config(config())
    meta = {n: (t.dtype, tuple(t.shape)) for n, t in fx.read_all(sources["vendor"]).items()}
    wrong = dict(meta)
    wrong["model.layers.1.self_attn.q_norm.weight"] = (torch.bfloat16, (64,))  # per-head, not all heads
    with pytest.raises(LayoutError, match=r"q_norm.weight: shape \(64,\), expected \(256,\) from the config"):
        m2.plan_tensors(cfg, wrong)
    missing = {
        n: v for n, v in meta.items() if n != "model.layers.2.block_sparse_moe.e_score_correction_bias"
    }
    with pytest.raises(LayoutError, match=r"lacks 1 tensor\(s\) .*e_score_correction_bias"):
        m2.plan_tensors(cfg, missing)
    no_experts = {
        n: v for n, v in meta.items() if not n.startswith("model.layers.0.block_sparse_moe.experts.")
    }
    with pytest.raises(LayoutError, match=r"layer 0: the checkpoint has no expert tensors"):
        m2.plan_tensors(cfg, no_experts)


def test_hf_layout(sources, converted):
    """The release's names, one 2-D MXFP8 tensor per expert with `weight_scale_inv`, attention MXFP8 too
    (default scope all), config.json with porter's mxfp8 quantization_config in place of the FP8 one; the
    bytes equal the porter layout's of the same scope."""
    art = converted["fp8-hf"]
    cfg = json.loads((art / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert cfg["architectures"] == ["MiniMaxM2ForCausalLM"] and qc["quant_method"] == "mxfp8"
    gates = [f"model.layers.{i}.block_sparse_moe.gate" for i in range(3)]
    assert qc["ignored_layers"] == qc["modules_to_not_convert"] == ["lm_head", *gates]
    out = fx.read_all(art)
    e = "model.layers.2.block_sparse_moe.experts.5."
    assert out[e + "w1.weight"].shape == (128, 256) and out[e + "w1.weight_scale_inv"].shape == (128, 8)
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    porter_all = porter.convert(sources["fp8"], art.parent / "fp8-all", quantize="all", progress=False)
    pl = fx.read_all(porter_all["output"])
    w13 = pl[W13.format(2)]
    assert torch.equal(
        torch.cat([out[e + "w1.weight"], out[e + "w3.weight"]]).view(torch.uint8), w13[5].view(torch.uint8)
    )
    assert torch.equal(out[e + "w2.weight_scale_inv"], pl[W2.format(2) + "_scale"][5])
    import runtime

    ids = fx.prompt(9)
    hf_logits = runtime.load(art, device="cpu", backend="torch")(ids)
    assert torch.equal(hf_logits, runtime.load(porter_all["output"], device="cpu", backend="torch")(ids))


def test_inspect_says_which_activation(converted, sources):
    res = CliRunner().invoke(cli, ["inspect", str(converted["fp8"]), "--json"])
    rep = json.loads(res.output)
    assert rep["architecture"] == "minimax_m2" and rep["activation"]["name"] == "swiglu"
    assert rep["activation"]["provenance"]["alpha"] == "implied by hidden_act 'silu' (plain SwiGLU)"
    text = CliRunner().invoke(cli, ["inspect", str(sources["fp8"])]).output
    assert "layout vendor checkpoint, pre-quantized (fp8, block [128, 128])" in text
    assert "activation: swiglu  silu(g) * u" in text
    assert (
        "layout transformers checkpoint"
        in CliRunner().invoke(cli, ["inspect", str(sources["transformers"])]).output
    )


# ---------------------------------------------------------------------------------------------------
# porter verify
# ---------------------------------------------------------------------------------------------------


def _verify(art, *args):
    res = CliRunner().invoke(cli, ["-q", "verify", str(art), "--max-new-tokens", "2", *args])
    if res.exception and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("layout", ["fp8", "fp8-hf", "transformers"])
def test_verify_passes(converted, layout, tmp_path, stream):
    """Resident, and layer-streamed (exact bytes inside the pass, on the references' read of each layer)."""
    res = _verify(converted[layout], "--report", str(tmp_path / "r.json"), *(["--stream"] if stream else []))
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    ex = rep["exact"]
    want = {"fp8": "vendor, pre-quantized fp8-block source (rceil scales re-derived)"}
    want["fp8-hf"] = want["fp8"]
    want["transformers"] = "transformers"
    assert ex["layout"] == want[layout]
    assert [row["kind"] for row in rep["layers"]] == ["full/moe"] * 3
    assert rep["streaming"]["enabled"] == stream


@pytest.mark.parametrize("stream", [False, True])
def test_verify_fails_on_gate_up_reversed(sources, tmp_path, monkeypatch, stream):
    """A layout bug planted in the converter's plan ([w3; w1] instead of [w1; w3] in layer 1) converts into an
    artifact whose porter.json is consistent with the wrong bytes; verify's own table catches it: exit 1,
    naming the tensor."""
    original = m2.plan_tensors
    bad = W13.format(1)

    def buggy_plan(*args, **kwargs):
        return [
            dataclasses.replace(
                t, read_expert_rows=lambda read, e, f=t.read_expert_rows: list(reversed(f(read, e)))
            )
            if t.name == bad
            else t
            for t in original(*args, **kwargs)
        ]

    monkeypatch.setattr(m2, "plan_tensors", buggy_plan)
    porter.convert(sources["fp8"], tmp_path / "art", progress=False)
    res = _verify(tmp_path / "art", "--max-new-tokens", "0", *(["--stream"] if stream else []))
    assert res.exit_code == 1, res.output
    assert "integrity: ok" in res.output
    assert (
        f"verdict: FAIL — not faithful: layer 1: tensor {bad} (shard model-00001-of-00001.safetensors)"
        in res.output
    )
