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
    # the rule sits under its column: faithfulness against its per-layer limit, weight error <= 0.06, and
    # the quality columns information only (no threshold set)
    columns = (
        ("faith.err", "<=lim"),
        ("weight.err", "<=0.06"),
        ("layer.err", "info"),
        ("cosine", "info"),
        ("rel.err", "info"),
    )
    for col, rule in columns:
        end = header.index(col) + len(col)
        assert rules[end - len(rule) : end] == rule, (col, rules)
    assert (
        "faithfulness (the artifact computes what the source computes under MXFP8 rounding): decides" in table
    )
    assert (
        "quality (what MXFP8 costs against the bf16 source): info, not judged (--max-layer-error / "
        "--min-cosine to judge it)" in table
    )
    assert re.search(
        r"\n  weight error \(second opinion\) max 0\.02\d+ \[<= 0.06, --max-weight-error\]\n", table
    )
    assert "bit-identical [decides: any differing byte fails]" in table
    ends = next(ln for ln in table.splitlines() if ln.startswith("faithfulness of the ends"))
    assert re.fullmatch(
        r"faithfulness of the ends \[decides\]: embeddings 0 \[<= [\d.e-]+\]  final logits 0 "
        r"\[<= [\d.e-]+\] \(relative, the same input to both\)",
        ends,
    ), ends
    logits = next(ln for ln in table.splitlines() if ln.startswith("  KL(ref||conv)"))
    assert re.fullmatch(
        r"  KL\(ref\|\|conv\) [\d.e-]+ \[info\]  top-1 [\d.]+% \[info\]  "
        r"top-5 overlap [\d.]+% \[info\]  max\|diff\| [\d.]+ \[info\]",
        logits,
    ), logits
    assert "top-5 overlap: |top-5(ref) & top-5(conv)| / 5 (a fraction)" in table
    assert "[info; --min-matching-tokens N decides]; mean KL" in table


def test_quality_thresholds_decide_when_set(artifact, tmp_path):
    """--max-kl and --min-top1 set: shown beside their figures, judged; crossing one fails (exit 1) with a
    verdict that says it is quality, not faithfulness."""
    report = tmp_path / "r.json"
    res = cli(artifact, "--max-new-tokens", 0, "--max-kl", 0.5, "--min-top1", 0.99, "--report", report)
    assert res.exit_code == 1, res.output
    logits = next(ln for ln in res.output.splitlines() if ln.startswith("  KL(ref||conv)"))
    assert "[<= 0.5]" in logits and "top-1 " in logits and "[>= 99%]" in logits and "top-5 overlap" in logits
    assert "judged: --max-kl <= 0.5, --min-top1 >= 99%" in res.output
    verdict = res.output.strip().splitlines()[-1]
    assert verdict.startswith("verdict: FAIL — quality: final logits: top-1 agreement 0.")
    assert verdict.endswith(
        " < 0.99 (--min-top1); faithful otherwise: bytes identical; every layer, the "
        "embeddings and the logits within float rounding of the rounded source (worst 0 of "
        "its limit)"
    )
    rep = json.loads(report.read_text())
    (f,) = rep["failures"]
    assert (f["check"], f["field"], f["threshold"]) == ("quality", "min_top1", 0.99)
    assert rep["quality_judged"] == ["max_kl", "min_top1"]


def test_json_figures_say_what_decides_and_what_top5_measures(passed):
    rep = json.loads(passed[0].stdout)
    figs = rep["figures"]
    assert figs["layers[].faith_error"] | {"measures": ""} == {
        "measures": "",
        "kind": "faithfulness",
        "decides": True,
        "fails_when": "above its layers[].faith_limit (float rounding: faithfulness.limit_basis)",
    }
    for key in ("faithfulness.logits_error", "faithfulness.embeddings_error", "exact.tensors[].mismatched"):
        assert figs[key]["decides"] and figs[key]["kind"] == "faithfulness", key
    assert figs["layers[].cosine"] == {
        "measures": figs["layers[].cosine"]["measures"],
        "kind": "quality",
        "decides": False,
        "threshold": "min_cosine",
        "option": "--min-cosine",
        "limit": None,
        "fails_when": "never: information only (decides with --min-cosine)",
    }
    assert figs["layers[].weight_error"]["decides"] and figs["layers[].weight_error"]["limit"] == 0.06
    for info in ("layers[].rel_error", "logits.max_abs_diff", "embeddings", "generation[].kl", "logits.kl"):
        assert figs[info]["decides"] is False and figs[info]["kind"] == "quality", info
    assert figs["generation[].first_divergence"]["decides"] is False  # --min-matching-tokens 0
    top5 = figs["logits.top5"]
    assert "overlap of the two models' top-5 token sets as a fraction" in top5["measures"]
    assert top5["threshold"] == "min_top5" and top5["limit"] is None
    # every threshold bounds some figure, and every figure key names a place in the report
    assert {f.name for f in fields(Thresholds)} == {d["threshold"] for d in figs.values() if "threshold" in d}
    for key in figs:
        head = key.split(".")[0].removesuffix("[]")
        assert head in rep, key
    assert rep["faithfulness"]["limit_basis"].startswith(
        "float rounding: K u sqrt(1 + (2/K) ||out|| / ||d||)"
    )
    set_ = figure_table(Thresholds(min_matching_tokens=2, min_cosine=0.9))
    assert (
        set_["generation[].first_divergence"]["decides"]
        and set_["generation[].first_divergence"]["limit"] == 2
    )
    assert set_["layers[].cosine"]["decides"] and set_["layers[].cosine"]["fails_when"] == "below 0.9"


# ---------------------------------------------------------------------------------------------------
# The picture: labels clear of every line, exact zeros drawn as such, no info series beside a threshold,
# a FAIL picture that shows what failed


def _svg(path):
    return ET.parse(path).getroot()


def _points(el) -> list:
    return [tuple(map(float, p.split(","))) for p in el.get("points").split()]


def _crosses(points: list, box: tuple) -> bool:
    """Whether the polyline through `points` enters box (x0, y0, x1, y1): its segments sampled finely."""
    x0, y0, x1, y1 = box
    for (ax, ay), (bx, by) in zip(points, points[1:]):
        for k in range(101):
            x, y = ax + (bx - ax) * k / 100, ay + (by - ay) * k / 100
            if x0 <= x <= x1 and y0 <= y <= y1:
                return True
    return False


def _label_box(t) -> tuple:
    """The box a 10 px sans-serif label covers: width at most 0.62 em per character, ascent 0.8 em."""
    x, y, size = float(t.get("x")), float(t.get("y")), float(t.get("font-size"))
    return x, y - 0.8 * size, x + 0.62 * size * len(t.text), y + 0.25 * size


def _panels(root) -> dict:
    return {g.get("data-name"): g for g in root.iter(SVG + "g") if g.get("class") == "panel"}


@pytest.fixture(scope="module")
def failed_plot(artifact, tmp_path_factory):
    """A FAIL picture with every kind of line: --numerics both, quality thresholds set, one layer's scales
    shifted (re-sealed: bytes and faithfulness fail there): (svg root, JSON report)."""
    from verify_tamper import rewrite_tensor, shift_scales

    d = tmp_path_factory.mktemp("failed_plot")
    art = copy_artifact(artifact, d / "art")
    rewrite_tensor(art, "model.layers.2.block_sparse_moe.experts.w13_weight_scale", shift_scales(+1))
    args = ["--numerics", "both", "--max-layer-error", 0.03, "--min-cosine", 0.99, "--max-new-tokens", 0]
    res = cli(art, *args, "--plot", d / "r.svg", "--report", d / "r.json")
    assert res.exit_code == 1, res.output
    return _svg(d / "r.svg"), json.loads((d / "r.json").read_text())


@pytest.mark.parametrize("which", ["passed", "failed"])
def test_plot_labels_clear_of_every_line_and_of_each_other(passed, failed_plot, which):
    root = _svg(passed[1]) if which == "passed" else failed_plot[0]
    labels = [t for t in root.iter(SVG + "text") if t.get("class") == "threshold"]
    lines = [p for p in root.iter(SVG + "polyline")]  # every series and every threshold line
    assert labels and lines
    boxes = [_label_box(t) for t in labels]
    for t, box in zip(labels, boxes):
        assert not any(_crosses(_points(p), box) for p in lines), t.text
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)
    for p in [p for p in lines if p.get("class") == "threshold-line"]:
        assert p.get("stroke-dasharray") and p.find(SVG + "title").text in [t.text for t in labels]


def test_plot_threshold_labels_name_what_they_bound(passed, failed_plot):
    texts = lambda root: [t.text for t in root.iter(SVG + "text") if t.get("class") == "threshold"]
    assert texts(_svg(passed[1])) == ["limit: float rounding", "<= 0.06 (--max-weight-error)"]
    assert texts(failed_plot[0]) == [
        "limit: float rounding",
        "serving: limit: float rounding",
        "<= 0.06 (--max-weight-error)",
        "<= 0.03 (--max-layer-error)",
        "<= 0.01 (cosine >= 0.99) (--min-cosine)",
    ]


def test_plot_draws_exact_zeros_on_their_own_labelled_row(passed):
    """On the CPU every faithfulness figure is exactly 0: drawn hollow on the '0 (exact)' row under the log
    axis, not at some small number."""
    panel = _panels(_svg(passed[1]))["faithfulness"]
    zero = next(t for t in panel.iter(SVG + "text") if t.get("class") == "zero-axis")
    assert zero.text == "0 (exact)"
    dots = [c for c in panel.iter(SVG + "circle") if c.get("data-series") == "faith_error"]
    assert len(dots) == 4 and all(float(c.get("data-value")) == 0.0 for c in dots)
    row = float(zero.get("y")) - 3  # the label's baseline sits 3 px under the row's centre
    assert all(abs(float(c.get("cy")) - row) < 0.11 and c.get("fill") == "white" for c in dots)
    decades = [float(t.get("y")) - 4 for t in panel.iter(SVG + "text") if (t.text or "").startswith("1e")]
    assert row > max(decades) + 6  # below the lowest decade line, apart from it
    # a non-zero value is not drawn on that row: the weight error of a quantized layer
    weights = [c for c in _panels(_svg(passed[1]))["weights"].iter(SVG + "circle")]
    assert float(weights[1].get("data-value")) > 0.02 and float(weights[1].get("cy")) < row


def test_plot_panels_with_a_threshold_hold_only_what_it_bounds(passed, failed_plot):
    """An information-only series never shares a panel with a dashed line (it would read as a failure)."""
    for root in (_svg(passed[1]), failed_plot[0]):
        for name, g in _panels(root).items():
            dashed = [p for p in g.iter(SVG + "polyline") if p.get("class") == "threshold-line"]
            series = [p for p in g.iter(SVG + "polyline") if p.get("class") == "series"]
            assert series, name
            roles = {p.get("data-role") for p in series}
            assert roles == ({"decides"} if dashed else {"info"}), (name, roles)
            assert g.get("data-decides") == str(bool(dashed)).lower()
    passed_panels = _panels(_svg(passed[1]))
    assert passed_panels["rel_error"].get("data-decides") == "false"
    assert passed_panels["layer_error"].get("data-decides") == "false"  # no --max-layer-error: info
    assert _panels(failed_plot[0])["layer_error"].get("data-decides") == "true"


def test_fail_plot_shows_what_failed(failed_plot):
    root, rep = failed_plot
    failure = [t for t in root.iter(SVG + "text") if t.get("class") == "failure"]
    messages = [f["message"] for f in rep["failures"]]
    assert len(messages) > 4 and len(failure) == 5
    for t, m in zip(failure, messages[:4]):  # the message, cut to the width; the whole of it as tooltip
        shown = "".join(t.itertext())[len(m) :]  # itertext: the tooltip first, then the line
        assert t.find(SVG + "title").text == m and (
            shown == m or (shown.endswith("…") and m.startswith(shown[:-1]))
        )
        assert len(shown) <= 160
    more = failure[4].find(SVG + "title").text
    assert more == f"... and {len(messages) - 4} more failure(s) (the JSON report lists them all)"
    verdict = next(t for t in root.iter(SVG + "text") if t.get("class") == "verdict")
    assert "FAIL (first failing layer 2)" in verdict.text and verdict.get("fill") == "#d62728"
    panels = _panels(root)
    faith = [c for c in panels["faithfulness"].iter(SVG + "circle") if c.get("class") == "fail"]
    assert {(c.get("data-layer"), c.get("data-serving")) for c in faith} == {("2", "false"), ("2", "true")}
    title = next(t for t in panels["faithfulness"].iter(SVG + "text") if t.get("class") == "panel-title")
    assert title.text.endswith("— FAIL") and title.get("fill") == "#d62728"
    band = [r for r in panels["faithfulness"].iter(SVG + "rect") if r.get("class") == "failing-layer"]
    assert len(band) == 1
    # the quality panel with its threshold set marks its own crossings; the info panel marks none
    assert any(c.get("class") == "fail" for c in panels["layer_error"].iter(SVG + "circle"))
    assert not any(c.get("class") == "fail" for c in panels["rel_error"].iter(SVG + "circle"))


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
    want = sorted(f.name for f in fields(Thresholds) if f.name != "min_matching_tokens")
    assert sorted(p.name for p in floats) == want
    assert all(isinstance(p.type, FiniteFloat) for p in floats)
    helps = {p.name: p.help for p in floats}
    assert all("Default: unset (reported, not judged)" in helps[n] for n in want if n != "max_weight_error")
    assert "Default 0.06; decides." in helps["max_weight_error"]
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
        "pass that one with --reference DIR|REPO_ID; first failure: not faithful: layer 0: "
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
