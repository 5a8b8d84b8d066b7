"""`porter convert --layout hf`: the vendor layout vLLM and sglang load, with porter's MXFP8 bytes.

The engines themselves are exercised by tests/engines (own venv); here: names, dtypes, shapes, the
config.json contract, byte equality with the porter layout, the runtime, and refusals."""

import json
import re

import pytest
import torch
from click.testing import CliRunner
from tensor_checks import load_all, same_bytes

import converters
import converters.minimax_m3 as m3
import porter
import runtime
from converters.minimax_m3.hf_layout import _check_format_groups
from porter.cli import main as cli
from porter.errors import LayoutError

arch = converters.get("minimax_m3_vl")  # the MiniMax-M3 converter

E, I, H = 8, 64, 64  # tiny checkpoint: experts, expert width, hidden
TEXT_LINEAR = re.compile(
    r"^language_model\.(lm_head|model\.layers\.\d+\.(self_attn\.\w+_proj|mlp\.\w+_proj|"
    r"block_sparse_moe\.(gate|shared_experts\.\w+_proj|experts\.\d+\.w[123])))$"
)


@pytest.fixture(scope="module")
def hf_art(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "hf"
    porter.convert(tiny_vendor, out, layout="hf", max_shard_size="300KB", progress=False)
    return out


@pytest.fixture(scope="module")
def porter_all(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("pall") / "pall"
    porter.convert(tiny_vendor, out, quantize="all", progress=False)
    return out


def test_config_json_contract(hf_art, tiny_vendor):
    cfg = json.loads((hf_art / "config.json").read_text())
    src = json.loads((tiny_vendor / "config.json").read_text())
    assert cfg["architectures"] == ["MiniMaxM3SparseForConditionalGeneration"]
    assert cfg["model_type"] == "minimax_m3_vl" and "quantization_config" not in cfg["text_config"]
    qc = cfg["quantization_config"]
    assert {
        k: qc[k] for k in ("quant_method", "activation_scheme", "weight_block_size", "fmt", "scale_fmt")
    } == {
        "quant_method": "mxfp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, 32],
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
    }
    assert not [k for k in qc if k.startswith("moe_quant")]
    assert qc["ignored_layers"] == qc["modules_to_not_convert"]
    # scope all: only lm_head and the router gates stay unquantized (3 MoE layers)
    assert sorted(qc["ignored_layers"]) == ["language_model.lm_head"] + [
        f"language_model.model.layers.{l}.block_sparse_moe.gate" for l in (1, 2, 3)
    ]
    # vLLM reads swiglu_beta without a default: the resolved value is written; source fields kept
    assert cfg["text_config"]["swiglu_beta"] == 1.0
    assert {k: v for k, v in cfg["text_config"].items() if k != "swiglu_beta"} == src["text_config"]


def test_names_dtypes_shapes(hf_art):
    t = load_all(hf_art)
    text = [n for n in t if n.startswith("language_model.")]
    assert not [n for n in t if n.startswith(("model.", "lm_head."))], (
        "text tensors must carry language_model."
    )
    assert not [n for n in t if "w13_weight" in n or "w2_weight" in n], "experts must never be stacked"
    assert not [n for n in t if n.endswith(".weight_scale")], "scales are named weight_scale_inv"
    for layer in (1, 2, 3):
        for e in range(E):
            p = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
            for w, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
                assert (
                    t[p + w + ".weight"].dtype == torch.float8_e4m3fn
                    and tuple(t[p + w + ".weight"].shape) == shape
                )
                s = t[p + w + ".weight_scale_inv"]
                assert s.dtype == torch.uint8 and tuple(s.shape) == (shape[0], shape[1] // 32)
    assert len(text) == 243  # every text tensor of the tiny model, scales included


def test_each_linear_quantized_xor_listed(hf_art):
    t = load_all(hf_art)
    listed = set(json.loads((hf_art / "config.json").read_text())["quantization_config"]["ignored_layers"])
    modules = {
        n[: -len(".weight")] for n in t if n.endswith(".weight") and TEXT_LINEAR.match(n[: -len(".weight")])
    }
    assert len(modules) > 100
    for m in modules:
        quantized = t[m + ".weight"].dtype == torch.float8_e4m3fn and m + ".weight_scale_inv" in t
        assert quantized != (m in listed), m
        if not quantized:
            assert m + ".weight_scale_inv" not in t and t[m + ".weight"].dtype != torch.float8_e4m3fn, m


def test_same_mxfp8_bytes_as_porter_layout(hf_art, porter_all):
    hf, pl = load_all(hf_art), load_all(porter_all)
    compared = 0
    for layer in (1, 2, 3):
        w13, w13s = pl[m3.experts_w13_name(layer)], pl[m3.experts_w13_name(layer) + "_scale"]
        w2, w2s = pl[m3.experts_w2_name(layer)], pl[m3.experts_w2_name(layer) + "_scale"]
        for e in range(E):
            p = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}."
            assert same_bytes(torch.cat([hf[p + "w1.weight"], hf[p + "w3.weight"]]), w13[e])  # [gate; up]
            assert same_bytes(
                torch.cat([hf[p + "w1.weight_scale_inv"], hf[p + "w3.weight_scale_inv"]]), w13s[e]
            )
            assert same_bytes(hf[p + "w2.weight"], w2[e]) and same_bytes(
                hf[p + "w2.weight_scale_inv"], w2s[e]
            )
            compared += 4
    for name, value in pl.items():  # everything else: same bytes under the hf name
        if "experts.w" in name:
            continue
        hf_name = (
            m3.hf_layout.hf_name(name[: -len("_scale")] + "_scale_inv")
            if name.endswith("weight_scale")
            else (m3.hf_layout.hf_name(name) if name.startswith(("model.", "lm_head.")) else name)
        )
        assert same_bytes(hf[hf_name], value), name
        compared += 1
    assert compared > 150


def test_runtime_loads_hf_layout_logits_equal(hf_art, porter_all):
    ids = torch.tensor([[1, 17, 40, 99, 250, 7, 3, 64, 128, 5, 11, 300, 42, 8]])  # > topk*block: sparse path
    a = runtime.load(hf_art)(ids)
    b = runtime.load(porter_all)(ids)
    assert torch.equal(a, b)
    c = runtime.load(hf_art, lazy=True)(ids)  # layer streaming builds the stacked experts per layer
    assert torch.equal(a, c)


def test_quantize_none_hf_is_plain_bf16(tiny_vendor, tmp_path):
    out = tmp_path / "none"
    porter.convert(tiny_vendor, out, layout="hf", quantize="none", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == m3.hf_layout.HF_ARCHITECTURES
    t = load_all(out)
    assert not [n for n in t if t[n].dtype == torch.float8_e4m3fn or n.endswith("_scale_inv")]
    src = load_all(tiny_vendor)
    assert all(same_bytes(t[n], v) for n, v in src.items())  # every source tensor, same name and bytes
    assert set(t) == set(src)


def test_scope_that_splits_a_group_is_refused(tiny_vendor, tmp_path):
    out = tmp_path / "x"
    res = CliRunner().invoke(
        cli, ["convert", str(tiny_vendor), "--output", str(out), "--layout", "hf", "--quantize", "experts"]
    )
    assert res.exit_code == 2
    msg = res.output.strip().splitlines()
    assert len(msg) == 1 and "shared expert" in msg[0] and "sglang" in msg[0] and "--quantize all" in msg[0]
    assert not out.exists() or not any(out.iterdir())


def test_group_check_names_qkv_index(tiny_vendor):
    from porter.source import open_local

    src = open_local(tiny_vendor)
    cfg = arch.resolve_config(src.raw_config)
    out = arch.plan_tensors(cfg, src.meta, "all")
    for t in out:
        if t.name == "model.layers.2.self_attn.index_k_proj.weight":
            t.quantize = False
    with pytest.raises(LayoutError, match=r"q/k/v/index_q/index_k projections of layer 2.*qkv_proj"):
        _check_format_groups(cfg, out, "custom")


def test_transformers_source_refused_for_hf(tiny_transformers, tmp_path):
    res = CliRunner().invoke(
        cli, ["convert", str(tiny_transformers), "--output", str(tmp_path / "o"), "--layout", "hf"]
    )
    assert res.exit_code == 2 and "--layout hf" in res.output and len(res.output.strip().splitlines()) == 1


def test_hf_canonical_map_refuses_missing_expert():
    names = [
        f"language_model.model.layers.1.block_sparse_moe.experts.{e}.{w}.weight"
        for e in range(2)
        for w in ("w1", "w2", "w3")
    ]
    assert arch.hf_layout.hf_canonical_map(names)[m3.experts_w13_name(1)] == [
        [names[0], names[2]],
        [names[3], names[5]],
    ]
    with pytest.raises(LayoutError, match="experts.0.w3"):
        arch.hf_layout.hf_canonical_map([n for n in names if not n.endswith("0.w3.weight")])
