"""`porter verify` on gpt-oss: PASS on artifacts of both source layouts (the release's MXFP4 experts
re-derived exactly, weight error 0), exit 1 naming the tensor when the conversion left gate/up interleaved
(a planted converter bug, which verify's own source table catches) or one expert's rows were reordered."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from gpt_oss_tiny_checkpoint import build_tiny_checkpoint
from verify_tamper import copy_artifact, rewrite_tensor

from converters import experts
from converters.gpt_oss import names
from porter import convert, verify
from porter.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
W13 = "model.layers.1.mlp.experts.w13_weight"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    src = build_tiny_checkpoint(tmp_path_factory.mktemp("gptoss-verify") / "src", "mxfp4", seed=21)
    art = src.parent / "art"
    convert(src, art, progress=False)
    return src, art


def _cli(*args):
    return CliRunner().invoke(main, ["-q", "verify", *map(str, args)])


@pytest.mark.parametrize("stream", [False, True])
def test_release_artifact_passes_with_exact_bytes(release, tmp_path, stream):
    """Resident, and layer-streamed (exact bytes inside the pass, on the references' read of each layer)."""
    _, art = release
    report = tmp_path / "verify.json"
    res = _cli(art, "--max-new-tokens", "4", "--report", report, *(["--stream"] if stream else []))
    assert res.exit_code == 0, res.output
    doc = json.loads(report.read_text())
    assert doc["verdict"] == "pass"
    exact = doc["exact"]
    assert exact["passed"] and "gpt-oss release" in exact["layout"] and "scale bytes kept" in exact["layout"]
    experts = [t for t in exact["tensors"] if t["tensor"].endswith(("w13_weight", "w2_weight"))]
    assert len(experts) == 8 and all(t["mismatched"] == 0 and t["weight_error"] == 0.0 for t in experts)
    assert not exact["unmapped_sources"]
    assert doc["logits"]["kl"] < 1e-6  # the same values on both sides: the runtime agrees with itself


def test_bf16_artifact_passes(tmp_path):
    src = build_tiny_checkpoint(tmp_path / "src", "bf16", seed=22)
    convert(src, tmp_path / "art", progress=False)
    rep = verify(tmp_path / "art", max_new_tokens=2).report
    assert rep.passed, rep.failures
    assert rep.exact.layout.startswith("transformers")


def test_planted_interleave_bug_fails_with_exit_1(release, tmp_path, monkeypatch):
    """A converter that forgets to uninterleave gate/up: its own output looks consistent, verify's
    independent table says which tensors are wrong."""
    src, _ = release
    monkeypatch.setattr(experts, "uninterleave_gate_up", lambda w: w)
    monkeypatch.setattr(names, "uninterleave_bias", lambda b: b)
    art = tmp_path / "buggy"
    convert(src, art, progress=False)
    monkeypatch.undo()
    report = tmp_path / "verify.json"
    res = _cli(art, "--max-new-tokens", "0", "--report", report)
    assert res.exit_code == 1, res.output
    assert "w13_weight" in res.output
    tensors = json.loads(report.read_text())["exact"]["tensors"]
    wrong = {t["tensor"].split("experts.")[-1] for t in tensors if t["mismatched"]}
    assert wrong == {"w13_weight", "w13_bias"}  # every layer's gate/up, weights and biases; down is right
    assert sum(1 for t in tensors if t["mismatched"]) == 8


def test_one_expert_reordered_is_named(release, tmp_path):
    _, good = release
    art = copy_artifact(good, tmp_path / "tampered")

    def interleave_expert(t):
        t = t.clone()
        t[3] = experts.interleave_gate_up(t[3])
        return t

    rewrite_tensor(art, W13, interleave_expert)  # integrity resealed: only the bytes check can catch it
    rewrite_tensor(art, W13 + "_scale", interleave_expert)
    rep = verify(art, max_new_tokens=0).report
    assert not rep.passed
    bad = next(t for t in rep.exact.tensors if t.tensor == W13)
    assert set(bad.mismatched_by_expert) == {3} and bad.mismatched > 0
