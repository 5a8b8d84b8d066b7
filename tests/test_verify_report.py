"""The `porter verify` report explains itself: which figures decide the verdict (and against which
threshold) and which are information only, in the table and the JSON; labelled threshold lines in the
plot; cut lists that say how many more; a hint when the reference looks like another checkpoint;
`--report -`; output paths and threshold values refused before any work (exit 2)."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from tiny_checkpoint import build_tiny_checkpoint
from verify_tamper import copy_artifact, flip_byte

import porter
from porter.cli import main
from porter.cli import verify as verify_command
from porter.cli_options import FiniteFloat
from porter.commands.verify import Thresholds, VerifyInputError, verify
from porter.commands.verify.thresholds import figure_table

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify_report") / "art"
    porter.convert(tiny_vendor, out, progress=False)
    return out


@pytest.fixture(scope="module")
def passed(artifact, tmp_path_factory):
    """One faithful run with the JSON report on stdout and the plot written: (result, svg path)."""
    plot = tmp_path_factory.mktemp("plot") / "r.svg"
    res = CliRunner().invoke(
        main, ["-q", "verify", str(artifact), "--report", "-", "--plot", str(plot), "--max-new-tokens", "3"]
    )
    assert res.exit_code == 0, res.output
    return res, plot


def cli(*args):
    return CliRunner().invoke(main, ["-q", "verify", *map(str, args)])


# ---------------------------------------------------------------------------------------------------
# What decides, what informs


def test_table_marks_deciding_columns_and_their_thresholds(passed):
    table = passed[0].stderr
    header, rules = [ln for ln in table.splitlines() if ln.startswith(("layer  type", "decides:"))]
    # the rule sits under its column: cosine >= 0.9, rel.err info, layer.err <= 0.08, weight.err <= 0.06
    columns = (("cosine", ">=0.9"), ("rel.err", "info"), ("layer.err", "<=0.08"), ("weight.err", "<=0.06"))
    for col, rule in columns:
        end = header.index(col) + len(col)
        assert rules[end - len(rule) : end] == rule, (col, rules)
    assert (
        "  decides: cosine (--min-cosine), layer.err (--max-layer-error), weight.err "
        "(--max-weight-error);" in table
    )
    assert re.search(
        r"\n  weight error \(second opinion\) max 0\.02\d+ \[<= 0.06, --max-weight-error\]\n", table
    )
    assert "bit-identical [decides: any differing byte fails]" in table
    logits = next(ln for ln in table.splitlines() if ln.startswith("  KL(ref||conv)"))
    assert re.fullmatch(
        r"  KL\(ref\|\|conv\) [\d.e-]+ \[<= 0.1\]  top-1 [\d.]+% \[>= 50%\]  "
        r"top-5 overlap [\d.]+% \[>= 70%\]  max\|diff\| [\d.]+ \[info\]",
        logits,
    ), logits
    assert "top-5 overlap: |top-5(ref) & top-5(conv)| / 5 (a fraction)" in table
    assert "[info; --min-matching-tokens N decides]; mean KL" in table


def test_json_figures_say_what_decides_and_what_top5_measures(passed):
    rep = json.loads(passed[0].stdout)
    figs = rep["figures"]
    assert figs["layers[].cosine"] == {
        "measures": figs["layers[].cosine"]["measures"],
        "decides": True,
        "threshold": "min_cosine",
        "option": "--min-cosine",
        "limit": 0.9,
        "fails_when": "below 0.9",
    }
    layer = figs["layers[].layer_error"]
    assert layer["limit"] == 0.08 and layer["fails_when"] == "above 0.08"
    assert figs["logits.kl"]["decides"] and figs["logits.kl"]["option"] == "--max-kl"
    for info in ("layers[].rel_error", "logits.max_abs_diff", "embeddings", "generation[].kl"):
        assert figs[info]["decides"] is False and "threshold" not in figs[info], info
    assert figs["generation[].first_divergence"]["decides"] is False  # --min-matching-tokens 0
    assert figs["exact.tensors[].mismatched"] == {
        "measures": figs["exact.tensors[].mismatched"]["measures"],
        "decides": True,
        "fails_when": "any differing block or element fails",
    }
    top5 = figs["logits.top5"]
    assert "overlap of the two models' top-5 token sets as a fraction" in top5["measures"]
    assert top5["limit"] == 0.7 and top5["threshold"] == "min_top5"
    # every threshold bounds some figure, and every figure key names a place in the report
    assert {f.name for f in fields(Thresholds)} == {d["threshold"] for d in figs.values() if "threshold" in d}
    for key in figs:
        head = key.split(".")[0].removesuffix("[]")
        assert head in rep, key
    with_tokens = figure_table(Thresholds(min_matching_tokens=2))["generation[].first_divergence"]
    assert with_tokens["decides"] and with_tokens["limit"] == 2 and with_tokens["fails_when"] == "below 2"


def test_plot_threshold_lines_are_labelled(passed):
    root = ET.parse(passed[1]).getroot()
    labels = [t for t in root.iter(SVG + "text") if t.get("class") == "threshold"]
    assert [t.text for t in labels] == [
        "layer output error <= 0.08 (--max-layer-error)",
        "weight error <= 0.06 (--max-weight-error)",
        "1 - cosine <= 0.1 (cosine >= 0.9, --min-cosine)",
    ]
    ys = [float(t.get("y")) for t in labels]
    assert abs(ys[0] - ys[1]) >= 12  # 0.08 and 0.06 are 5 px apart on the axis: labels kept apart
    assert all(60 + 10 <= y <= 60 + 280 for y in ys)  # inside the panels (y0 60, height 280), below titles
    dashed = [ln for ln in root.iter(SVG + "line") if ln.get("stroke-dasharray")]
    assert len(dashed) == 3 and [ln.find(SVG + "title").text for ln in dashed] == [t.text for t in labels]
    legend = " ".join(t.text or "" for t in root.iter(SVG + "text"))
    assert "residual rel. error (end to end; info)" in legend


# ---------------------------------------------------------------------------------------------------
# --report -, and bad paths / thresholds refused before any work


def test_report_dash_stdout_is_pure_json(passed):
    res = passed[0]
    rep = json.loads(res.stdout)
    assert rep["verdict"] == "pass" and [r["layer"] for r in rep["layers"]] == [0, 1, 2, 3]
    assert "verdict: PASS" in res.stderr and "verdict: PASS" not in res.stdout
    assert not Path("-").exists()


def _never_runs(monkeypatch):
    import porter.commands.verify as v

    def ran(*a, **k):
        raise AssertionError("verification ran")

    monkeypatch.setattr(v, "check_integrity", ran)


@pytest.mark.parametrize("option", ["--report", "--plot"])
def test_output_path_in_a_missing_folder_refused_first(artifact, tmp_path, monkeypatch, option):
    _never_runs(monkeypatch)
    path = tmp_path / "no-such-folder" / ("r.json" if option == "--report" else "r.svg")
    res = cli(artifact, option, path)
    assert res.exit_code == 2 and res.output.splitlines() == [
        f"porter: error: {option} {path}: folder {path.parent} does not exist; create it or give another path"
    ]
    res = cli(tmp_path / "no-artifact", option, path)  # checked before the artifact is even opened
    assert res.exit_code == 2 and f"folder {path.parent} does not exist" in res.output
    with pytest.raises(VerifyInputError, match="does not exist"):
        verify(artifact, **{option[2:]: path})


@pytest.mark.parametrize(
    "flag,value,want",
    [
        ("--min-top1", "nan", "a number in [0, 1]"),
        ("--min-top5", "1.5", "a number in [0, 1]"),
        ("--max-kl", "inf", "a finite number >= 0"),
        ("--max-kl", "-inf", "a finite number >= 0"),
        ("--max-layer-error", "NaN", "a finite number >= 0"),
        ("--max-weight-error", "-0.1", "a finite number >= 0"),
        ("--min-cosine", "1.01", "a number in [-1, 1]"),
        ("--min-top1", "abc", "is not a number"),
    ],
)
def test_bad_threshold_values_exit_2(artifact, monkeypatch, flag, value, want):
    _never_runs(monkeypatch)
    res = cli(artifact, flag, value)
    assert res.exit_code == 2, res.output
    err = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(err) == 1 and err[0].startswith(f"Error: Invalid value for '{flag}': "), res.output
    assert want in err[0], err


def test_every_float_option_of_verify_is_finite_and_ranged():
    floats = [p for p in verify_command.params if p.type.name == "float"]
    want = sorted(f.name for f in fields(Thresholds) if f.type in (float, "float"))
    assert sorted(p.name for p in floats) == want
    assert all(isinstance(p.type, FiniteFloat) for p in floats)
    t = {p.name: p.type for p in floats}
    assert t["min_top1"].convert("1", None, None) == 1.0 and t["max_kl"].convert("0", None, None) == 0.0
    with pytest.raises(click.BadParameter):
        t["min_top5"].convert("-0.01", None, None)
    tokens = next(p for p in verify_command.params if p.name == "min_matching_tokens")
    assert cli("x", "--min-matching-tokens", -1).exit_code == 2 and tokens.type.min == 0
    for bad in ({"min_top1": float("nan")}, {"max_kl": float("inf")}, {"min_cosine": -2}):
        with pytest.raises(VerifyInputError, match="threshold"):
            Thresholds.build(bad)


# ---------------------------------------------------------------------------------------------------
# Cut lists and the other-checkpoint hint


def test_reference_of_other_weights_hinted_and_lists_cut(artifact, tmp_path):
    other = build_tiny_checkpoint(tmp_path / "seed1", layout="vendor", seed=1)  # same shapes, other weights
    report = tmp_path / "r.json"
    res = cli(artifact, "--reference", other, "--max-new-tokens", 0, "--report", report)
    assert res.exit_code == 1, res.output
    rep = json.loads(report.read_text())
    tensors = rep["exact"]["tensors"]
    bad = [t for t in tensors if t["mismatched"]]
    assert len(bad) > len(tensors) / 2
    verdict = next(ln for ln in res.output.splitlines() if ln.startswith("verdict: FAIL"))
    assert verdict.startswith(
        f"verdict: FAIL — {len(bad)} of {len(tensors)} re-derived tensors differ: "
        f"the reference {other} may be a different checkpoint than the one converted; "
        "pass that one with --reference DIR|REPO_ID; first failure: layer 0: "
    )
    assert verdict.endswith(f" (and {len(rep['failures']) - 1} more failure(s))")
    assert rep["summary"] == verdict.removeprefix("verdict: FAIL — ")
    listed = [ln for ln in res.output.splitlines() if ln.startswith("  - ")]
    assert len(listed) == 20 and f"  ... and {len(bad) - 20} more differing tensor(s)" in res.output
    # a stacked expert tensor: 8 experts differ, 4 named, the rest counted
    f = next(f for f in rep["failures"] if f["tensor"] and f["tensor"].endswith("w13_weight"))
    cut = r" in 8 expert\(s\) \((expert \d: \d+, ){4}\.\.\. and 4 more\)"
    assert re.search(cut, f["message"]), f["message"]


def test_integrity_issue_list_says_how_many_more(artifact, tmp_path):
    art = copy_artifact(artifact, tmp_path / "art")
    names = [n for n in json.loads((art / "porter.json").read_text())["tensors"] if ".layers." in n][:25]
    for n in names:
        flip_byte(art, n)
    report = tmp_path / "r.json"
    res = cli(art, "--report", report)
    assert res.exit_code == 1
    issues = json.loads(report.read_text())["integrity"]["issues"]
    assert len(issues) == 25  # one per changed tensor (its digest names it)
    assert f"integrity: FAILED ({len(issues)} issue(s); any issue fails)" in res.output
    assert f"  ... and {len(issues) - 20} more issue(s)" in res.output
    assert sum(ln.startswith("  - ") for ln in res.output.splitlines()) == 20
