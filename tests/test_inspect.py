"""`porter inspect DIR [--json]` on artifacts (both layouts) and checkpoints: what it reports is checked
against the manifest, the shard headers and the config, not against fixed numbers."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

import porter
from porter.cli import main as cli


def run(*args) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["inspect", *map(str, args)])
    return res.exit_code, res.output


def report(path) -> dict:
    code, out = run(path, "--json")
    assert code == 0, out
    return json.loads(out)


def tensor_bytes(d: Path) -> int:
    total = 0
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                n = 1
                for s in t.get_shape():
                    n *= s
                total += n * {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}[t.get_dtype()]
    return total


@pytest.fixture(scope="module")
def arts(tiny_vendor, tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    porter.convert(tiny_vendor, d / "porter", progress=False)  # scope experts
    porter.convert(tiny_vendor, d / "hf", layout="hf", progress=False)  # scope all
    return d


def test_porter_artifact(arts, tiny_vendor):
    rep = report(arts / "porter")
    doc = json.loads((arts / "porter" / "porter.json").read_text())
    assert rep["kind"] == "porter artifact" and rep["layout"] == "porter"
    assert (
        rep["source"]["path"] == str(Path(tiny_vendor).resolve())
        and rep["source"]["options"]["quantize"] == "experts"
    )
    q = rep["quantization"]
    assert q["quant_method"] == "mxfp8" and q["scope"] == "experts"
    assert q["quantized"] == {
        "model.layers.{l}.block_sparse_moe.experts.w13_weight": 3,
        "model.layers.{l}.block_sparse_moe.experts.w2_weight": 3,
    }
    assert q["contract"] == {"checked": True, "both": [], "neither": [], "ok": True}
    assert rep["config"]["rotary_dim"] == {"value": 16, "from": "config:text_config.partial_rotary_factor"}
    assert rep["config"]["swiglu_beta"] == {"value": 1.0, "from": "default"}
    assert rep["sizes"]["bytes"] == tensor_bytes(arts / "porter") and rep["sizes"]["tensors"] == len(
        doc["tensors"]
    )
    errs = sorted((r["rel_fro_error"] for r in doc["tensors"].values() if "rel_fro_error" in r), reverse=True)
    assert [w["rel_fro_error"] for w in rep["worst_tensors"]] == errs[:10] and len(errs) == 6


def test_hf_artifact_text(arts):
    rep = report(arts / "hf")
    doc = json.loads((arts / "hf" / "porter.json").read_text())
    assert rep["layout"] == "hf" and rep["quantization"]["quantized_modules"] == 106
    assert rep["quantization"]["ignored_layers"][0] == "language_model.lm_head"
    assert rep["quantization"]["contract"]["ok"] and rep["quantization"]["modules_to_not_convert_equal"]
    errs = sorted(
        ((r["rel_fro_error"], n) for n, r in doc["tensors"].items() if "rel_fro_error" in r), reverse=True
    )
    assert [(w["rel_fro_error"], w["tensor"]) for w in rep["worst_tensors"]] == errs[:10]
    code, text = run(arts / "hf")
    assert code == 0
    assert "layout hf" in text and "each linear quantized xor listed: yes" in text
    assert "worst 10 tensors by relative error" in text and errs[0][1] in text
    assert "swiglu_beta" in text and "<- config:text_config.swiglu_beta" in text


def test_contract_violation_is_reported(arts, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(arts / "hf", bad)
    cfg = json.loads((bad / "config.json").read_text())
    q = "language_model.model.layers.0.self_attn.q_proj"  # quantized, and now also listed
    cfg["quantization_config"]["ignored_layers"].append(q)
    cfg["quantization_config"]["ignored_layers"].remove("language_model.lm_head")  # bf16, and now unlisted
    (bad / "config.json").write_text(json.dumps(cfg))
    c = report(bad)["quantization"]["contract"]
    assert c["both"] == [q] and c["neither"] == ["language_model.lm_head"] and not c["ok"]
    assert "NO (both:" in run(bad)[1]


def test_checkpoints(tiny_vendor, tmp_path):
    rep = report(tiny_vendor)
    assert rep["kind"] == "checkpoint" and rep["layout"] == "vendor checkpoint" and rep["worst_tensors"] == []
    assert rep["source"]["commit"] is None and rep["quantization"]["quantized_modules"] == 0
    sha = "0123456789abcdef0123456789abcdef01234567"  # a Hugging Face cache snapshot names its commit
    snap = tmp_path / "models--x--y" / "snapshots" / sha
    shutil.copytree(tiny_vendor, snap)
    assert report(snap)["source"]["commit"] == sha


def test_prequantized_checkpoint_layout(arts):
    rep = report(arts / "hf")  # porter's hf output is itself a vendor-style MXFP8 checkpoint ...
    assert rep["layout"] == "hf"
    shutil.copytree(arts / "hf", arts / "hf-as-checkpoint")
    (arts / "hf-as-checkpoint" / "porter.json").unlink()  # ... read without its manifest
    rep = report(arts / "hf-as-checkpoint")
    assert (
        rep["kind"] == "checkpoint"
        and rep["layout"] == "vendor checkpoint, pre-quantized (mxfp8, block [1, 32])"
    )
    assert rep["quantization"]["quantized_modules"] == 106 and rep["quantization"]["contract"]["ok"]


def test_bad_input_one_line_exit_2(tmp_path):
    code, out = run(tmp_path / "missing")
    assert code == 2 and len(out.strip().splitlines()) == 1 and "not a directory" in out
    (tmp_path / "empty").mkdir()
    code, out = run(tmp_path / "empty")
    assert code == 2 and "config.json" in out and len(out.strip().splitlines()) == 1


@pytest.mark.parametrize("model_type", ["llama", None])
def test_architecture_porter_does_not_convert_is_still_inspected(tmp_path, model_type):
    """A checkpoint of another architecture (a Llama here, or none named): exit 0, its files, tensors,
    dtypes and sizes from the headers, and one line saying porter does not convert it."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "llama"
    d.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
    if model_type:
        cfg["model_type"] = model_type
    (d / "config.json").write_text(json.dumps(cfg))
    a = {"model.embed_tokens.weight": torch.zeros(100, 64, dtype=torch.bfloat16)}
    b = {
        "model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.bfloat16),
        "model.norm.weight": torch.zeros(64),
    }
    save_file(a, str(d / "model-00001-of-00002.safetensors"))
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    rep = report(d)
    assert rep["kind"] == "checkpoint" and rep["layout"] == "checkpoint" and rep["config"] == {}
    assert rep["architecture"] is None and rep["model_type"] == model_type and rep["activation"] == {}
    assert rep["not_converted"].startswith(
        f"model_type {model_type!r} is not an architecture porter converts"
    )
    assert rep["files"] == [
        {"file": "model-00001-of-00002.safetensors", "tensors": 1, "bytes": 100 * 64 * 2},
        {"file": "model-00002-of-00002.safetensors", "tensors": 2, "bytes": 128 * 64 * 2 + 64 * 4},
    ]
    assert rep["sizes"] == {
        "tensors": 3,
        "shards": 2,
        "bytes": tensor_bytes(d),
        "bytes_by_dtype": {"BF16": (100 + 128) * 64 * 2, "F32": 64 * 4},
    }
    code, text = run(d)
    assert code == 0, text
    assert f"model_type {model_type!r} is not an architecture porter converts (porter converts: " in text
    assert "model-00002-of-00002.safetensors  2 tensors, 16.64 KB" in text and "resolved config" not in text
