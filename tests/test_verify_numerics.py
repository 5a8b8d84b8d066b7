"""`porter verify --numerics w8a16|serving|both`: the serving run (MoE input and SwiGLU output as MXFP8, the
torch MoE backend) beside the w8a16 run, each against its own thresholds, in the table, the JSON and the plot;
a backend that does not compute the serving numerics refused with one line (exit 2)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import porter
from porter.cli import main
from porter.commands.verify import SERVING_DEFAULTS, Thresholds, VerifyInputError, verify

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify_numerics") / "art"
    porter.convert(tiny_vendor, out, progress=False)
    return out


@pytest.fixture(scope="module")
def both(artifact, tmp_path_factory):
    """One --numerics both run: (CLI result, JSON report, svg path)."""
    d = tmp_path_factory.mktemp("both")
    res = CliRunner().invoke(
        main,
        [
            "-q",
            "verify",
            str(artifact),
            "--numerics",
            "both",
            "--report",
            str(d / "r.json"),
            "--plot",
            str(d / "r.svg"),
            "--max-new-tokens",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    return res, json.loads((d / "r.json").read_text()), d / "r.svg"


def cli(*args):
    return CliRunner().invoke(main, ["-q", "verify", *map(str, args)])


def test_both_runs_in_the_json_with_their_own_thresholds(both):
    _, rep, _ = both
    assert rep["verdict"] == "pass" and rep["numerics_mode"] == "both"
    w, s = rep["numerics"]["w8a16"], rep["numerics"]["serving"]
    assert (w["backend"], s["backend"], s["note"]) == ("auto", "auto", "")  # both runs as asked
    assert rep["layers"] == w["layers"] and rep["logits"] == w["logits"]  # the first run is also on top
    assert len(s["layers"]) == len(w["layers"]) == 4
    assert w["thresholds"] == rep["thresholds"] and w["thresholds"]["max_kl"] == 0.10
    assert {k: s["thresholds"][k] for k in SERVING_DEFAULTS["experts"]} == SERVING_DEFAULTS["experts"]
    assert s["thresholds"]["max_weight_error"] == w["thresholds"]["max_weight_error"]  # the same weights
    fig = rep["figures"]["numerics.serving.logits.kl"]
    assert fig["decides"] and fig["option"] == "--max-kl"
    assert fig["limit"] == SERVING_DEFAULTS["experts"]["max_kl"] == 0.15
    assert not rep["figures"]["numerics.serving.layers[].rel_error"]["decides"]


def test_serving_adds_a_plausible_amount_of_error(both):
    """Quantizing the MoE input and the SwiGLU output (each element within half an e4m3 ulp, ~3 % rms) adds
    error of the size of the weight quantization's: on the tiny checkpoint (seed 0, the default prompt)
    KL 0.0098 -> 0.0148, worst layer error 0.033 -> 0.047. Bounds: more error, at most 3x; the dense
    layer 0 has no MoE, so it stays exact in both runs."""
    _, rep, _ = both
    w, s = rep["numerics"]["w8a16"], rep["numerics"]["serving"]
    assert 1.1 * w["logits"]["kl"] < s["logits"]["kl"] < 3 * w["logits"]["kl"]
    lw, ls = (max(r["layer_error"] for r in x["layers"]) for x in (w, s))
    assert 1.1 * lw < ls < 3 * lw
    for rw, rs in zip(w["layers"][1:], s["layers"][1:]):  # every MoE layer: more error, of the same order
        assert rw["layer_error"] < rs["layer_error"] < 3 * rw["layer_error"]
    assert w["layers"][0]["layer_error"] == s["layers"][0]["layer_error"] == 0.0
    assert s["logits"]["top1"] >= 0.8 and s["logits"]["top5"] >= 0.8


def test_table_sets_the_runs_side_by_side_with_their_thresholds(both):
    out = both[0].output
    assert "numerics w8a16 (MXFP8 weights, activations as given): backend auto" in out
    side = out[out.index("numerics side by side") :]
    kl = next(ln for ln in side.splitlines() if "KL(ref||conv)" in ln)
    assert "[<= 0.1]" in kl and f"[<= {SERVING_DEFAULTS['experts']['max_kl']:g}]" in kl
    assert "serving (auto)" in side and "[info]" in side


def test_plot_has_the_serving_series_and_its_thresholds(both):
    root = ET.parse(both[2]).getroot()
    labels = [t.text for t in root.iter(SVG + "text") if t.get("class") == "threshold"]
    lim = SERVING_DEFAULTS["experts"]
    assert f"serving layer output error <= {lim['max_layer_error']:g} (--max-layer-error, serving)" in labels
    assert f"serving 1 - cosine <= {1 - lim['min_cosine']:.3g} (--min-cosine, serving)" in labels
    assert len([ln for ln in root.iter(SVG + "polyline")]) == 6  # 3 + 1 (w8a16), 2 (serving)


def test_unknown_numerics_refused(artifact):
    with pytest.raises(VerifyInputError, match="numerics 'w8a8': want one of w8a16, serving, both"):
        verify(artifact, numerics="w8a8")


def test_tightened_threshold_fails_the_serving_run_only(artifact):
    """--max-kl 0.012 lies between the w8a16 KL (0.0098) and the serving KL (0.0148) of this artifact."""
    assert cli(artifact, "--max-kl", "0.012", "--max-new-tokens", "0").exit_code == 0
    res = cli(artifact, "--numerics", "serving", "--max-kl", "0.012", "--max-new-tokens", "0")
    assert res.exit_code == 1, res.output
    assert "verdict: FAIL — serving numerics: final logits: KL(ref||conv) 0.01" in res.output
    r = verify(artifact, numerics="both", thresholds={"max_kl": 0.012}, max_new_tokens=0)
    assert not r.passed and [(f.check, f.numerics) for f in r.failures] == [("logits", "serving")]
    assert r.failures[0].threshold == 0.012 and 0.012 < r.failures[0].value < 0.02


def test_serving_defaults_are_the_serving_thresholds(artifact):
    r = verify(artifact, numerics="serving", max_new_tokens=0).report
    assert r.passed and list(r.numerics) == ["serving"] and r.backend == "auto"
    assert r.thresholds == Thresholds.build(None, "experts", "serving") and r.thresholds.max_kl == 0.15
    assert r.layers == r.numerics["serving"].layers


def test_serving_refused_for_an_unquantized_artifact(tiny_vendor, tmp_path):
    out = tmp_path / "none"
    porter.convert(tiny_vendor, out, quantize="none", progress=False)
    with pytest.raises(VerifyInputError, match="--numerics serving needs MXFP8 experts"):
        verify(out, numerics="serving")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_both_at_real_dims_on_cuda(tmp_path):
    """At MiniMax-M3's layer shapes (3 layers, 8 experts) on a GPU: the serving run computes on the backend
    auto picks (triton on Hopper, which computes the serving numerics too), adds error, and passes."""
    from tiny_checkpoint import build_tiny_checkpoint, real_dims_overrides

    src = build_tiny_checkpoint(tmp_path / "src", seed=0, text_overrides=real_dims_overrides(3))
    porter.convert(src, tmp_path / "art", progress=False)
    r = verify(tmp_path / "art", device="cuda", numerics="both", max_new_tokens=4).report
    w, s = r.numerics["w8a16"], r.numerics["serving"]
    assert r.passed, r.summary
    assert s.backend == w.backend and s.note == ""
    assert max(x.layer_error for x in s.layers) > max(x.layer_error for x in w.layers)
