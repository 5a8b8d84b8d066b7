"""`porter verify` on artifacts converted from pre-quantized sources: the vendor MXFP8 layout (quant_method
mxfp8, U8 weight_scale_inv) and block-FP8 (quant_method fp8, fp32 weight_scale_inv per 128x128 tile).

verify reads such a reference as the conversion did (dequantized tensor by tensor) and re-derives every byte
by the rule porter.json records (options.source_quantization): an MXFP8 source keeps its own scale bytes
for every row taken from one of its weights (whole weights and row slices alike), block-FP8 values are
rounded to bf16 once and re-quantized with rceil. The MXFP8 sources here are encoded with every other
block's scale one above porter's rceil choice, so
re-quantizing their values with rceil alone would give other bytes: passing proves the kept-scale rule.
Checkpoints are built in code from the tiny one (helpers shared with test_prequantized.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tensor_checks import same_bytes
from test_prequantized import (
    FP8_CONFIG,
    MXFP8_CONFIG,
    fp8_block128,
    load_all,
    mxfp8_scale_up,
    requantized_checkpoint,
)
from verify_tamper import rewrite_tensor

import converters
import porter
from porter.cli import main
from porter.commands.verify import verify
from porter.format import mxfp8

arch = converters.get("minimax_m3_vl")  # the MiniMax-M3 converter

LAYER = 2
W13 = f"model.layers.{LAYER}.block_sparse_moe.experts.w13_weight"
EXPERT = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def mx_source(tiny_vendor, tmp_path_factory) -> Path:
    return requantized_checkpoint(
        tiny_vendor, tmp_path_factory.mktemp("vpq") / "mx", mxfp8_scale_up, MXFP8_CONFIG
    )


@pytest.fixture(scope="module")
def fp8_source(tiny_vendor, tmp_path_factory) -> Path:
    return requantized_checkpoint(
        tiny_vendor, tmp_path_factory.mktemp("vpq") / "fp8", fp8_block128, FP8_CONFIG
    )


@pytest.fixture
def source(request, mx_source, fp8_source) -> Path:
    return {"mxfp8": mx_source, "fp8": fp8_source}[request.param]


def cli(*args):
    res = CliRunner().invoke(main, ["-q", "verify", *map(str, args)])
    if res.exception and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def exact_report(art: Path, tmp_path: Path, *extra) -> dict:
    res = cli(art, "--report", tmp_path / "r.json", *extra)
    assert res.exit_code == 0, res.output
    assert "verdict: PASS" in res.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["exact"]["passed"] and rep["exact"]["unmapped_sources"] == []
    return rep


# ---------------------------------------------------------------------------------------------------
# Faithful conversions pass


@pytest.mark.parametrize("quantize, stream", [("experts", False), ("all", False), ("all", True)])
def test_mxfp8_source_verifies_with_kept_scale_bytes(mx_source, tmp_path, quantize, stream):
    """Also layer-streamed: exact bytes inside the pass, the rounded reference re-derived with the kept
    scale bytes from the bf16 reference's reads."""
    porter.convert(mx_source, tmp_path / "art", quantize=quantize, progress=False)
    man = json.loads((tmp_path / "art" / "porter.json").read_text())
    assert man["options"]["source_quantization"] == {
        "method": "mxfp8",
        "weight_block_size": [1, 32],
        "dequantized_dtype": "bfloat16",
        "scale_bytes": "kept-rows",
    }
    rep = exact_report(tmp_path / "art", tmp_path, "--max-new-tokens", 2, *(["--stream"] if stream else []))
    assert rep["streaming"]["enabled"] == stream
    ex = rep["exact"]
    assert ex["layout"] == "vendor, pre-quantized mxfp8 source (scale bytes kept)"
    quantized = [t for t in ex["tensors"] if t["quantized"]]
    assert len(quantized) == (6 if quantize == "experts" else 6 + 4 * 4 + 3 * 2 + 3 * 3 + 3)
    # MXFP8 -> MXFP8 with the source's scale bytes is the identity on values: zero weight error
    assert all(t["mismatched"] == 0 and t["weight_error"] == 0.0 for t in quantized)
    # the attention projections of an "experts" conversion are the dequantized source values, bit for bit
    carried = {t["tensor"] for t in ex["tensors"] if not t["quantized"] and t["mismatched"] == 0}
    assert ("model.layers.0.self_attn.q_proj.weight" in carried) == (quantize == "experts")
    # and the rule matters: rceil alone on the dequantized values gives other scale bytes in every raised
    # block (half of them) and in a few more (a block max that rounded down to 224 * 2^e)
    src = load_all(mx_source)
    w1 = f"language_model.model.layers.{LAYER}.block_sparse_moe.experts.{EXPERT}.w1.weight"
    kept = src[w1[: -len("weight")] + "weight_scale_inv"]
    _, rceil = mxfp8.quantize(mxfp8.dequantize(src[w1], kept, torch.bfloat16))
    assert bool((rceil[:, 1::2] != kept[:, 1::2]).all()) and int((rceil != kept).sum()) > kept.numel() // 2
    # numerics run on the dequantized reference: the converted model computes with the same weight values
    assert rep["logits"]["kl"] < 1e-3 and rep["logits"]["top1"] == 1.0, rep["logits"]


@pytest.mark.parametrize("stream", [False, True])
def test_fp8_block_source_verifies(fp8_source, tmp_path, stream):
    porter.convert(fp8_source, tmp_path / "art", quantize="all", progress=False)
    man = json.loads((tmp_path / "art" / "porter.json").read_text())
    assert man["options"]["source_quantization"] == {
        "method": "fp8-block",
        "weight_block_size": [128, 128],
        "dequantized_dtype": "bfloat16",
        "scale_bytes": "rederived",
    }
    rep = exact_report(tmp_path / "art", tmp_path, "--max-new-tokens", 2, *(["--stream"] if stream else []))
    assert rep["streaming"]["enabled"] == stream
    assert rep["exact"]["layout"] == "vendor, pre-quantized fp8-block source (rceil scales re-derived)"
    quantized = [t for t in rep["exact"]["tensors"] if t["quantized"]]
    assert len(quantized) == 6 + 4 * 4 + 3 * 2 + 3 * 3 + 3
    # MXFP8 rceil of the dequantized (bf16) block-FP8 values: ~2-4 % rms, below the 0.06 threshold (a
    # tensor whose tile scales happen to be powers of two comes through exactly)
    errors = sorted(t["weight_error"] for t in quantized)
    assert (
        all(t["mismatched"] == 0 for t in quantized) and errors[-1] < 0.05 and errors[len(errors) // 2] > 0.02
    )


def transformers_mxfp8_source(tmp_path: Path) -> tuple[Path, dict]:
    """The tiny transformers-layout checkpoint with q/k/v/o and the fused dense / shared gate_up_proj.weight
    [2N, H] (+ down_proj) stored as MXFP8, every other block's scale one above rceil's; routed experts bf16."""
    from tiny_checkpoint import build_tiny_checkpoint

    bf16 = build_tiny_checkpoint(tmp_path / "bf16", layout="transformers", seed=0)
    quantized = re.compile(
        r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate_up|down)_proj|"
        r"mlp\.shared_experts\.(gate_up|down)_proj)\.weight"
    )
    src = requantized_checkpoint(bf16, tmp_path / "mx", mxfp8_scale_up, MXFP8_CONFIG, quantized=quantized)
    return src, load_all(src)


def test_transformers_layout_mxfp8_source_slices_keep_their_scale_bytes(tmp_path):
    """A fused gate_up_proj.weight stored as MXFP8 is split by the conversion into row halves; each half
    keeps the source's scale rows (a scale row belongs to its value row), as q/k/v/o keep theirs. verify
    re-derives the same rule ("kept-rows"), so the conversion passes with every byte identical."""
    src, tensors = transformers_mxfp8_source(tmp_path)
    porter.convert(src, tmp_path / "art", quantize="all", progress=False)
    man = json.loads((tmp_path / "art" / "porter.json").read_text())
    assert man["options"]["source_quantization"]["scale_bytes"] == "kept-rows"
    out = load_all(tmp_path / "art")
    for layer, fused, parts in (
        (0, "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
        (
            1,
            "mlp.shared_experts.gate_up_proj",
            ("block_sparse_moe.shared_experts.gate_proj", "block_sparse_moe.shared_experts.up_proj"),
        ),
    ):
        q, s = (tensors[f"model.layers.{layer}.{fused}.weight{x}"] for x in ("", "_scale_inv"))
        n = q.shape[0] // 2
        for half, part in enumerate(parts):
            name = f"model.layers.{layer}.{part}.weight"
            assert same_bytes(out[name + "_scale"], s[half * n : (half + 1) * n]), (
                name
            )  # kept, not re-derived
            assert same_bytes(out[name], q[half * n : (half + 1) * n]), name  # hence the values' bytes too
    # and rceil alone would have given other bytes for those halves (every raised block)
    gate_q, gate_s = (tensors["model.layers.0.mlp.gate_up_proj.weight" + x] for x in ("", "_scale_inv"))
    _, rceil = mxfp8.quantize(mxfp8.dequantize(gate_q, gate_s, torch.bfloat16))
    assert bool((rceil[:, 1::2] != gate_s[:, 1::2]).all())
    assert same_bytes(
        out["model.layers.0.self_attn.q_proj.weight_scale"],
        tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"],
    )
    rep = verify(tmp_path / "art", max_new_tokens=0).report
    assert rep.exact.passed and rep.passed, rep.summary
    quantized = [t for t in rep.exact.tensors if t.quantized]
    assert quantized and all(t.mismatched == 0 for t in quantized)
    from_mxfp8 = {
        t.tensor: t.weight_error for t in quantized if re.search(r"\.[qkvo]_proj|mlp\.|shared", t.tensor)
    }
    # q/k/v/o of 4 layers, gate/up/down of the dense layer and of the shared expert of 3 MoE layers
    assert len(from_mxfp8) == 4 * 4 + 3 + 3 * 3 and set(from_mxfp8.values()) == {0.0}, from_mxfp8
    assert {
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
    } <= set(from_mxfp8)


def test_legacy_kept_record_rederives_slices(tmp_path):
    """An artifact whose porter.json records scale_bytes "kept" (earlier porters: whole weights kept, row
    slices re-derived) is verified by that rule: this one's kept halves then differ from the rceil bytes."""
    src, _ = transformers_mxfp8_source(tmp_path)
    porter.convert(src, tmp_path / "art", quantize="all", progress=False)
    man = json.loads((tmp_path / "art" / "porter.json").read_text())
    man["options"]["source_quantization"]["scale_bytes"] = "kept"
    (tmp_path / "art" / "porter.json").write_text(json.dumps(man))
    rep = verify(tmp_path / "art", max_new_tokens=0).report
    bad = {t.tensor for t in rep.exact.tensors if t.quantized and t.mismatched}
    assert (
        "model.layers.0.mlp.gate_proj.weight" in bad and "model.layers.0.self_attn.q_proj.weight" not in bad
    )
    assert not rep.exact.passed


@pytest.mark.parametrize("source", ["mxfp8", "fp8"], indirect=True)
def test_hf_layout_of_a_prequantized_source_verifies(source, tmp_path):
    porter.convert(source, tmp_path / "art", layout="hf", progress=False)  # scope all
    rep = exact_report(tmp_path / "art", tmp_path, "--max-new-tokens", 0)
    one = f"language_model.model.layers.{LAYER}.block_sparse_moe.experts.{EXPERT}.w3.weight"
    checks = {t["tensor"]: t for t in rep["exact"]["tensors"]}
    assert checks[one]["quantized"] and checks[one]["blocks"] == 64 * 2


def test_porter_hf_output_as_source_verifies(tiny_vendor, tmp_path):
    """porter's own --layout hf output is an MXFP8 checkpoint: converted back to the porter layout it
    verifies against it (from porter.json's source, and given explicitly with --reference)."""
    porter.convert(tiny_vendor, tmp_path / "hf", layout="hf", progress=False)
    porter.convert(tmp_path / "hf", tmp_path / "art", quantize="all", progress=False)
    rep = exact_report(tmp_path / "art", tmp_path, "--max-new-tokens", 0)
    assert rep["reference"] == str(tmp_path / "hf")
    assert all(t["weight_error"] == 0.0 for t in rep["exact"]["tensors"])
    res = cli(tmp_path / "art", "--reference", tmp_path / "hf", "--max-new-tokens", 0)
    assert res.exit_code == 0, res.output


# ---------------------------------------------------------------------------------------------------
# Unfaithful conversions fail, naming the tensor


@pytest.mark.parametrize("source", ["mxfp8", "fp8"], indirect=True)
@pytest.mark.parametrize("what", ["value", "scale"])
def test_planted_byte_edit_named(source, tmp_path, what):
    porter.convert(source, tmp_path / "art", progress=False)
    name = W13 if what == "value" else W13 + "_scale"

    def edit(t):
        t = t.clone()
        raw = t.view(torch.uint8)
        b = int(raw[EXPERT, 5, 1])  # a value byte (NaN code avoided) or a scale byte
        raw[EXPERT, 5, 1] = (
            (b ^ 0x01 if (b ^ 0x01) & 0x7F != 0x7F else b ^ 0x02) if what == "value" else b + 1
        )
        return t

    rewrite_tensor(tmp_path / "art", name, edit)  # porter.json re-sealed: integrity passes
    res = cli(tmp_path / "art", "--max-new-tokens", 0)
    assert res.exit_code == 1, res.output
    assert "integrity: ok" in res.output
    assert (
        f"tensor {W13} (shard model-00001-of-00001.safetensors): 1 of 2048 32-block(s) differ" in res.output
    )
    assert (
        f"({int(what == 'scale')} with a different scale byte) in 1 expert(s) (expert {EXPERT}: 1)"
        in res.output
    )


@pytest.mark.parametrize("source", ["mxfp8", "fp8"], indirect=True)
def test_gate_up_reversed_in_the_converter(source, tmp_path, monkeypatch):
    original = arch.plan_tensors

    def buggy_plan(*args, **kwargs):  # [w3; w1] instead of [w1; w3], kept scale bytes travelling with it
        return [
            dataclasses.replace(
                t, read_expert_rows=lambda read, e, f=t.read_expert_rows: list(reversed(f(read, e)))
            )
            if t.name == W13
            else t
            for t in original(*args, **kwargs)
        ]

    monkeypatch.setattr(arch, "plan_tensors", buggy_plan)
    porter.convert(source, tmp_path / "art", progress=False)
    res = cli(tmp_path / "art", "--max-new-tokens", 0)
    assert res.exit_code == 1, res.output
    assert "integrity: ok" in res.output
    assert f"tensor {W13} (shard model-00001-of-00001.safetensors): " in res.output
    assert "in 8 expert(s)" in res.output


# ---------------------------------------------------------------------------------------------------
# A reference that is not what the artifact was converted from: exit 2, one line


def test_reference_quantization_must_match_the_record(mx_source, fp8_source, tiny_vendor, tmp_path):
    porter.convert(mx_source, tmp_path / "art", progress=False)
    res = cli(tmp_path / "art", "--reference", tiny_vendor)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert (
        "an unquantized checkpoint, but porter.json options.source_quantization says the artifact was "
        "converted from a pre-quantized mxfp8 checkpoint (block [1, 32])" in lines[0]
    )
    res = cli(tmp_path / "art", "--reference", fp8_source)
    assert res.exit_code == 2 and "a pre-quantized fp8-block checkpoint (block [128, 128])" in res.output
    porter.convert(tiny_vendor, tmp_path / "bf16", progress=False)
    res = cli(tmp_path / "bf16", "--reference", mx_source)
    assert (
        res.exit_code == 2 and "converted from an unquantized checkpoint; pass that checkpoint" in res.output
    )
    man = json.loads((tmp_path / "art" / "porter.json").read_text())
    man["options"]["source_quantization"]["scale_bytes"] = "sometimes"
    (tmp_path / "art" / "porter.json").write_text(json.dumps(man))
    res = cli(tmp_path / "art")
    assert res.exit_code == 2 and "is not a rule this porter re-derives" in res.output
