"""gpt-oss conversion: config resolution with provenance, the MXFP4 release converted exactly (dequantized MXFP8
== dequantized MXFP4 for every block), transformers' bf16 layout converted with porter's MXFP8 rule, gate/up
uninterleaved (weights and biases), and bad sources refused with one line naming the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gpt_oss_tiny_checkpoint import GPT_OSS_20B, build_tiny_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

import converters
from porter import convert
from porter.errors import ConfigError, ConvertError, LayoutError, PorterError, PrequantizedError
from porter.format import mxfp4, mxfp8

pytestmark = pytest.mark.usefixtures("one_thread")


def _resolve(raw):
    return converters.for_config(raw).resolve_config(raw)


def test_gpt_oss_20b_config_resolves_with_provenance():
    cfg = _resolve(GPT_OSS_20B)
    assert (cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok) == (24, 32, 4)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim) == (2880, 2880, 201088, 64)
    assert cfg.is_sliding(0) and not cfg.is_sliding(1) and cfg.sliding_window == 128
    assert (cfg.swiglu_alpha, cfg.swiglu_beta, cfg.swiglu_limit) == (1.702, 1.0, 7.0)
    p = cfg.provenance
    assert p["swiglu_alpha"] == "default (transformers GptOssConfig)"
    assert p["swiglu_beta"].startswith("architecture") and p["swiglu_limit"] == "config:swiglu_limit"
    assert p["num_experts_per_tok"] == "config:num_experts_per_tok"
    assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor) == ("yarn", 150000.0, 32.0)
    assert p["rope_theta"] == "legacy:rope_theta" and p["rope_factor"] == "legacy:rope_scaling.factor"
    assert cfg.rope_truncate is False and cfg.rope_original_max_position_embeddings == 4096
    assert cfg.rope_attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1.0)
    assert cfg.gate_up_interleaved and cfg.eos_token_id == 200002
    facts = converters.for_config(GPT_OSS_20B).manifest_facts(cfg)
    assert facts["architecture"] == "gpt_oss" and facts["activation"]["limit"] == 7.0


def test_config_keys_of_transformers_and_defaults():
    flat = {
        k: v for k, v in GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta", "experts_per_token")
    }
    flat["rope_parameters"] = GPT_OSS_20B["rope_scaling"] | {"rope_theta": 150000.0}
    flat["swiglu_alpha"] = 1.5
    cfg = _resolve(flat)
    assert cfg.provenance["rope_theta"] == "config:rope_parameters.rope_theta"
    assert cfg.swiglu_alpha == 1.5 and cfg.provenance["swiglu_alpha"] == "config:swiglu_alpha"
    bare = _resolve({"model_type": "gpt_oss"})  # transformers GptOssConfig's defaults: gpt-oss-120b
    assert (bare.num_hidden_layers, bare.num_local_experts, bare.rope_type, bare.rope_factor) == (
        36,
        128,
        "yarn",
        32.0,
    )
    assert bare.layer_types[:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert bare.provenance["layer_types"].startswith("default")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"experts_per_token": 2}, "disagree: num_experts_per_tok = 4, experts_per_token = 2"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
            "rope_type' = 'longrope' is not supported",
        ),
        ({"layer_types": ["sliding_attention"] * 3}, "'layer_types' must be a list of 24 entries"),
        ({"layer_types": ["chunked_attention"] * 24}, "entries \\['chunked_attention'"),
        ({"swiglu_limit": "7"}, "'swiglu_limit' must be a finite number"),
        ({"num_key_value_heads": 7}, "multiple of num_key_value_heads"),
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ],
)
def test_bad_config_named(change, message):
    with pytest.raises(ConfigError, match=message):
        _resolve(GPT_OSS_20B | change)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("gptoss") / "mxfp4", "mxfp4", seed=4)


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("gptoss") / "bf16", "bf16", seed=4)


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def _f64_bits(t):
    return t.double().view(torch.int64)


def test_release_converts_exactly(release, tmp_path):
    out = tmp_path / "art"
    summary = convert(release, out, progress=False)
    src, art = _tensors(release), _tensors(out)
    man = json.loads((out / "porter.json").read_text())
    assert man["options"]["source_quantization"] == {
        "method": "mxfp4",
        "weight_block_size": [1, 32],
        "dequantized_dtype": "bfloat16",
        "scale_bytes": "kept-rows",
    }
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp8"
    cfg = _resolve(json.loads((release / "config.json").read_text()))
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        for src_name, out_name in (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight")):
            blocks, scales = src[p + src_name + "_blocks"], src[p + src_name + "_scales"]
            want = mxfp4.dequantize(blocks, scales, torch.float64)  # [E, N, K] the release's values
            if src_name == "gate_up_proj":  # rows gate0, up0, ... -> [gate; up]
                want = torch.cat([want[:, 0::2], want[:, 1::2]], dim=1)
            q, s = art[p + out_name], art[p + out_name + "_scale"]
            assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
            got = mxfp8.dequantize(q, s, torch.float64)
            assert torch.equal(_f64_bits(got), _f64_bits(want)), (layer, out_name)  # every block, bit for bit
            assert man["tensors"][p + out_name]["rel_fro_error"] == 0.0
        b = src[p + "gate_up_proj_bias"]
        assert torch.equal(art[p + "w13_bias"], torch.cat([b[:, 0::2], b[:, 1::2]], dim=1))
        assert torch.equal(art[p + "w2_bias"], src[p + "down_proj_bias"])
    carried = [n for n in src if "experts" not in n]
    assert carried and all(torch.equal(art[n].view(torch.uint8), src[n].view(torch.uint8)) for n in carried)
    assert summary["tensors"] == len(art)


def test_bf16_source_quantized_by_the_rule(bf16_source, tmp_path):
    out = tmp_path / "art"
    convert(bf16_source, out, progress=False)
    src, art = _tensors(bf16_source), _tensors(out)
    p = "model.layers.2.mlp.experts."
    gu, dn = src[p + "gate_up_proj"], src[p + "down_proj"]  # [E, H, 2I], [E, I, H]
    for e in range(gu.shape[0]):
        w = gu[e].t()  # [2I, H], rows gate0, up0, ...
        q, s = mxfp8.quantize(torch.cat([w[0::2], w[1::2]]))
        assert torch.equal(art[p + "w13_weight"][e].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(art[p + "w13_weight_scale"][e], s)
        q, s = mxfp8.quantize(dn[e].t().contiguous())
        assert torch.equal(art[p + "w2_weight"][e].view(torch.uint8), q.view(torch.uint8))
    man = json.loads((out / "porter.json").read_text())
    assert 0 < man["tensors"][p + "w13_weight"]["rel_fro_error"] < 0.05  # a real quantization


def test_quantize_all_scope(release, tmp_path):
    out = tmp_path / "all"
    convert(release, out, quantize="all", progress=False)
    art = _tensors(out)
    assert art["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert art["model.layers.0.self_attn.q_proj.bias"].dtype == torch.bfloat16
    assert art["model.layers.0.mlp.router.weight"].dtype == torch.bfloat16  # the router stays unquantized


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_sources_refused(release, tmp_path):
    with pytest.raises(PorterError, match="--gate-up uninterleaved"):
        convert(release, tmp_path / "a", gate_up="uninterleaved", progress=False)
    with pytest.raises(ConvertError, match="--layout hf: porter has no hf layout for architecture 'gpt_oss'"):
        convert(release, tmp_path / "b", layout="hf", progress=False)
    no_q = _copy(release, tmp_path / "no_q")  # the blocks without the config that says they are MXFP4
    cfg = json.loads((no_q / "config.json").read_text())
    cfg.pop("quantization_config")
    (no_q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayoutError, match="gate_up_proj_blocks: packed MXFP4 blocks, but config.json has no"):
        convert(no_q, tmp_path / "c", progress=False)
    fewer = _copy(release, tmp_path / "fewer")  # a config that does not belong to the weights
    cfg = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 32}))
    with pytest.raises(
        LayoutError, match=r"gate_up_proj_blocks: shape \[8, 128, 64\], expected \[8, 64, 64\]"
    ):
        convert(fewer, tmp_path / "d", progress=False)
    assert not (tmp_path / "d" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("byte, what", [(255, "scale byte 255"), (254, "a value of 2\\^128 or more")])
def test_unconvertible_mxfp4_block_named(release, tmp_path, byte, what):
    bad = _copy(release, tmp_path / "bad")
    name = "model.layers.3.mlp.experts.down_proj_scales"
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = _tensors_of(shard)
    tensors[name][5, 7, 1] = byte  # expert 5, row 7, block 1 (its codes are random: some are >= 2)
    save_file(tensors, str(shard))
    with pytest.raises(
        PrequantizedError,
        match=f"down_proj_blocks'\\[5\\]: MXFP4 1 block\\(s\\) with {what}.*, first at row 7, block 1",
    ):
        convert(bad, tmp_path / "out", progress=False)


def _tensors_of(f: Path) -> dict:
    with safe_open(str(f), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def test_inspect_reads_the_release(release):
    """`porter inspect` on the MXFP4 release: its experts as the quantized modules, the release's
    modules_to_not_convert patterns covering every other linear."""
    from porter.commands.inspect import inspect

    q = inspect(release)["quantization"]
    assert q["quant_method"] == "mxfp4" and q["quantized_modules"] == 8
    assert set(q["quantized"]) == {
        "model.layers.{l}.mlp.experts.gate_up_proj",
        "model.layers.{l}.mlp.experts.down_proj",
    }
    assert q["contract"] == {"checked": True, "both": [], "neither": [], "ok": True}
