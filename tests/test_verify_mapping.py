"""verify's source -> artifact mapping is its own: layout bugs planted in the converter's plan are caught.

Each test wraps the MiniMax-M3 converter's `plan_tensors` so one layer's experts are built wrong, converts the
tiny checkpoint with the bug (porter.json is then consistent with the wrong bytes: integrity passes), and
keeps the bug in place while verifying, so anything that asks the converter's plan (the runtime's
SourceStore included) sees the same wrong layout. Only verify's independent table can catch it: exit 1,
naming the tensor (and the expert). Also: a tampered shard header and an edited index are named."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from verify_tamper import copy_artifact, reseal_shard

import converters
import porter
from porter.cli import main
from porter.commands.verify import verify
from porter.source.local import read_header

arch = converters.get("minimax_m3_vl")  # the MiniMax-M3 converter

LAYER = 2
W13 = f"model.layers.{LAYER}.block_sparse_moe.experts.w13_weight"
W2 = f"model.layers.{LAYER}.block_sparse_moe.experts.w2_weight"


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def plant(monkeypatch, tensor: str, wrong_rows):
    """The converter's plan builds `tensor` with wrong_rows(original_rows_fn, read, e) -> [row parts]."""
    original = arch.plan_tensors

    def buggy_plan(*args, **kwargs):
        out = original(*args, **kwargs)
        return [
            dataclasses.replace(
                t, read_expert_rows=lambda read, e, f=t.read_expert_rows: wrong_rows(f, read, e)
            )
            if t.name == tensor
            else t
            for t in out
        ]

    monkeypatch.setattr(arch, "plan_tensors", buggy_plan)


def convert_and_verify(src, out):
    porter.convert(src, out, progress=False)
    res = CliRunner().invoke(main, ["-q", "verify", str(out), "--max-new-tokens", "0"])
    if res.exception and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def test_gate_up_reversed_when_stacking(tiny_vendor, tmp_path, monkeypatch):
    plant(monkeypatch, W13, lambda f, read, e: list(reversed(f(read, e))))  # [w3; w1] instead of [w1; w3]
    res = convert_and_verify(tiny_vendor, tmp_path / "art")
    assert res.exit_code == 1, res.output
    assert "integrity: ok" in res.output  # the artifact is what porter.json says: the bug is in the plan
    assert (
        f"verdict: FAIL — not faithful: layer {LAYER}: tensor {W13} (shard model-00001-of-00001.safetensors): "
        in res.output
    )
    assert "in 8 expert(s)" in res.output  # every expert of the layer


def test_gate_up_reversed_transformers_layout(tiny_transformers, tmp_path, monkeypatch):
    def swap_halves(f, read, e):
        (w,) = f(read, e)  # fused [2I, H]
        i = w.shape[0] // 2
        return [w[i:], w[:i]]

    plant(monkeypatch, W13, swap_halves)
    res = convert_and_verify(tiny_transformers, tmp_path / "art")
    assert res.exit_code == 1 and f"tensor {W13} (shard" in res.output and "in 8 expert(s)" in res.output


def test_swapped_expert_index(tiny_vendor, tmp_path, monkeypatch):
    plant(monkeypatch, W2, lambda f, read, e: f(read, {5: 6, 6: 5}.get(e, e)))
    res = convert_and_verify(tiny_vendor, tmp_path / "art")
    assert res.exit_code == 1
    assert f"tensor {W2} (shard model-00001-of-00001.safetensors): " in res.output
    assert "in 2 expert(s) (expert 5: " in res.output and "expert 6: " in res.output
    rep = verify(tmp_path / "art", max_new_tokens=0).report
    (bad,) = [t for t in rep.exact.tensors if not t.exact]
    assert bad.tensor == W2 and set(bad.mismatched_by_expert) == {5, 6}


def test_transposed_w2(tiny_vendor, tmp_path, monkeypatch):
    # H == I == 64 in the tiny model, so a transposed [I, H] w2 has the shape the plan promises
    plant(monkeypatch, W2, lambda f, read, e: [p.T.contiguous() for p in f(read, e)])
    res = convert_and_verify(tiny_vendor, tmp_path / "art")
    assert res.exit_code == 1 and f"tensor {W2} (shard" in res.output and "in 8 expert(s)" in res.output


def test_dropped_source_tensor_named(tiny_vendor, tmp_path, monkeypatch):
    drop = "vision_tower.vision_model.pre_layrnorm.weight"
    original = arch.plan_tensors
    monkeypatch.setattr(
        arch, "plan_tensors", lambda *a, **k: [t for t in original(*a, **k) if t.name != drop]
    )
    res = convert_and_verify(tiny_vendor, tmp_path / "art")
    assert res.exit_code == 1 and f"source tensor {drop} was not carried into the artifact" in res.output


# ---------------------------------------------------------------------------------------------------
# Tampered shard header, edited index


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("map") / "art"
    porter.convert(tiny_vendor, out, progress=False)
    return out


def rewrite_header(art, name: str, **changes) -> str:
    """Change a tensor's header entry (same byte length, so offsets stay valid) and re-seal the shard
    digests in porter.json: the tensor data and its digest are untouched."""
    man = json.loads((art / "porter.json").read_text())
    shard = art / man["tensors"][name]["shard"]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header[name].update(changes)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    shard.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])
    reseal_shard(man, shard)
    (art / "porter.json").write_text(json.dumps(man, indent=1))
    return shard.name


@pytest.mark.parametrize("change", [{"dtype": "U8"}, {"shape": [8, 64, 128]}])
def test_tampered_header_named(artifact, tmp_path, change):
    art = copy_artifact(artifact, tmp_path / "art")
    shard = rewrite_header(art, W13, **change)
    assert read_header(art / shard)[W13][next(iter(change))] == next(iter(change.values()))
    res = verify(art, max_new_tokens=0)
    (f,) = res.failures
    assert f.check == "integrity" and f.tensor == W13 and f.shard == shard
    assert f"tensor {W13} in shard {shard}: header says " in f.message


@pytest.mark.parametrize("streaming", [False, True])
def test_tampered_header_and_manifest_caught_by_rederivation(artifact, tmp_path, streaming):
    """Header and porter.json both say [8, 64, 128] (a consistent lie): the re-derivation names it, and no
    numerics are reported (layer-streamed: the pass stops at that layer, before the converted model is
    built from it; every tensor is still compared)."""
    art = copy_artifact(artifact, tmp_path / "art")
    rewrite_header(art, W13, shape=[8, 64, 128])
    man = json.loads((art / "porter.json").read_text())
    man["tensors"][W13]["shape"] = [8, 64, 128]
    man["tensors"][W13 + "_scale"]["shape"] = [8, 64, 4]
    (art / "porter.json").write_text(json.dumps(man, indent=1))
    rewrite_header(art, W13 + "_scale", shape=[8, 64, 4])
    res = verify(art, max_new_tokens=0, streaming=streaming)
    assert res.report.integrity.passed and not res.passed
    (f,) = [f for f in res.failures if f.check == "exact"]
    assert f.tensor == W13 and "shape [64, 128] but re-derived from" in f.message
    assert res.report.layers == [] and res.report.logits is None
    assert len(res.report.exact.tensors) == len([n for n in man["tensors"] if not n.endswith("_scale")])


@pytest.mark.parametrize("edit", ["moved", "dropped", "added"])
def test_edited_index_named(artifact, tmp_path, edit):
    art = copy_artifact(artifact, tmp_path / "art")
    p = art / "model.safetensors.index.json"
    index = json.loads(p.read_text())
    name = "model.layers.1.self_attn.q_proj.weight"
    if edit == "moved":
        index["weight_map"][name] = "model-00002-of-00002.safetensors"
    elif edit == "dropped":
        del index["weight_map"][name]
    else:
        name = "model.layers.9.self_attn.q_proj.weight"
        index["weight_map"][name] = "model-00001-of-00001.safetensors"
    p.write_text(json.dumps(index))
    res = CliRunner().invoke(main, ["-q", "verify", str(art), "--max-new-tokens", "0"])
    assert res.exit_code == 1
    want = {
        "moved": f"tensor {name}: index says shard model-00002-of-00002.safetensors, porter.json "
        "model-00001-of-00001.safetensors",
        "dropped": f"tensor {name} is in the porter.json but not the index",
        "added": f"tensor {name} is in the index but not porter.json",
    }[edit]
    assert want in res.output


# ---------------------------------------------------------------------------------------------------
# Every real layout and scope re-derives exactly


@pytest.mark.parametrize(
    "layout,gate_up,quantize",
    [
        ("vendor", "uninterleaved", "all"),
        ("transformers", "uninterleaved", "all"),
        ("transformers", "interleaved", "experts"),
    ],
)
def test_layouts_and_scopes_rederive_exactly(tmp_path, layout, gate_up, quantize):
    from tiny_checkpoint import build_tiny_checkpoint

    over = {"gate_up_interleaved": True} if gate_up == "interleaved" else None
    src = build_tiny_checkpoint(tmp_path / "src", layout=layout, seed=1, gate_up=gate_up, text_overrides=over)
    porter.convert(src, tmp_path / "art", quantize=quantize, progress=False)
    rep = verify(tmp_path / "art", max_new_tokens=0).report
    ex = rep.exact
    assert ex.passed and ex.unmapped_sources == [], [t for t in ex.tensors if not t.exact]
    assert ex.layout == (
        "vendor"
        if layout == "vendor"
        else "transformers" + (" (interleaved gate/up)" if gate_up == "interleaved" else "")
    )
    quantized = {t.tensor for t in ex.tensors if t.quantized}
    assert "model.layers.1.block_sparse_moe.experts.w13_weight" in quantized
    if quantize == "all":  # fused shared gate_up_proj split by the gate_half / up_half rules
        assert {
            "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
            "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
            "model.layers.1.self_attn.index_q_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        } <= quantized
    assert rep.passed, rep.summary


def test_hf_artifact_layout_rederives_exactly(tiny_vendor, tmp_path):
    """`porter convert --layout hf`: one 2-D tensor per expert under the vendor names; each is re-derived
    from the source and the reference model is built from the same table."""
    from verify_tamper import nudge_e4m3, rewrite_tensor

    porter.convert(tiny_vendor, tmp_path / "art", layout="hf", progress=False)
    rep = verify(tmp_path / "art", max_new_tokens=2).report
    assert rep.passed, rep.summary
    names = {t.tensor for t in rep.exact.tensors if t.quantized}
    one = f"language_model.model.layers.{LAYER}.block_sparse_moe.experts.3.w3.weight"
    assert one in names and rep.exact.unmapped_sources == []
    assert rep.layers[LAYER].kind == "sparse/moe" and rep.layers[LAYER].weight_error > 0.02
    rewrite_tensor(tmp_path / "art", one, nudge_e4m3(5, 40))
    res = verify(tmp_path / "art", max_new_tokens=0)
    (f,) = [f for f in res.failures if f.check == "exact"]
    assert f.tensor == one and f.layer == LAYER and "1 of 128 32-block(s) differ" in f.message
    assert "first at row 5, block 1" in f.message


@pytest.mark.parametrize("gate_up", ["uninterleaved", "interleaved"])
def test_table_reads_one_expert_of_a_fused_source(tiny_vendor, tmp_path, gate_up):
    """The per-expert rules (an hf-layout artifact name) on a transformers checkpoint of the same weights
    read exactly the vendor checkpoint's w1 / w3 / w2 of that expert."""
    from tiny_checkpoint import build_tiny_checkpoint

    from porter.commands.verify.mapping import Mapping, SourceShards

    fused = build_tiny_checkpoint(tmp_path / "hf", layout="transformers", seed=0, gate_up=gate_up)
    table, vendor = (
        Mapping(SourceShards(fused), interleaved=gate_up == "interleaved"),
        SourceShards(tiny_vendor),
    )
    for w in ("w1", "w3", "w2"):
        name = f"model.layers.{LAYER}.block_sparse_moe.experts.5.{w}.weight"
        d = table.derive(name, None)
        assert d.sources == [
            f"model.layers.{LAYER}.mlp.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}"
        ]
        assert torch.equal(d.value(None), vendor.read("language_model." + name))


def test_truncating_instead_of_rounding_caught_though_the_statistics_pass(tiny_vendor, tmp_path, monkeypatch):
    """A converter that truncates w/2^e toward zero instead of rounding to nearest even lands at a weight
    error the statistical threshold accepts; the bytes do not match the rule recorded in porter.json."""
    from porter.format import mxfp8

    original = mxfp8.quantize_with_error

    def truncating(w, rounding="rceil", name="tensor", **kw):
        q, s, err = original(w, rounding, name, **kw)
        x = w.float().reshape(*s.shape, mxfp8.BLOCK) * mxfp8.scale_multipliers(s).reciprocal().unsqueeze(-1)
        t = x.clamp(-mxfp8.E4M3_MAX, mxfp8.E4M3_MAX).to(torch.float8_e4m3fn)  # nearest even ...
        low = torch.where(t.float().abs() > x.abs(), _toward_zero(t), t)  # ... then one step toward zero
        return low.reshape(w.shape), s, err

    monkeypatch.setattr(mxfp8, "quantize_with_error", truncating)
    porter.convert(tiny_vendor, tmp_path / "art", progress=False)
    rep = verify(tmp_path / "art", max_new_tokens=0).report
    bad = [t for t in rep.exact.tensors if t.mismatched]
    assert {t.tensor for t in bad} == {
        f"model.layers.{l}.block_sparse_moe.experts.{w}_weight" for l in (1, 2, 3) for w in ("w13", "w2")
    }
    assert all(t.mismatched > 0.5 * t.blocks for t in bad)  # nearly every block has a rounded-up element
    assert all(0.03 < t.weight_error < 0.06 for t in bad)  # the second opinion alone would pass it
    assert not rep.passed and rep.failures[0].check == "exact"


def _toward_zero(q: torch.Tensor) -> torch.Tensor:
    """The e4m3 value one step closer to zero (codes are sign-magnitude: magnitude code - 1)."""
    raw = q.view(torch.uint8)
    mag = raw & 0x7F
    return torch.where(mag > 0, raw - 1, raw).view(torch.float8_e4m3fn)
