"""Terminal table of a `porter verify` report, and the optional JSON / plot outputs.

Every figure says whether it decides the verdict (its threshold and flag beside it) or is information
only; the JSON report's `figures` says the same per key (thresholds.FIGURES)."""

from __future__ import annotations

import logging

from porter.commands.verify.thresholds import option_name, threshold_rule
from porter.commands.verify.verdict import Report, experts_text, more_line

SHOWN = 20  # lines of a cut list (integrity issues, differing tensors) before "... and N more"
LAYER_LEGEND = [
    "  faith.err: the layer alone, converted vs the source rounded by verify's MXFP8 re-derivation, both fed the",
    "    bf16 source's hidden state h: ||out_conv - out_rounded|| / ||out_rounded - h|| (decides: <= faith.lim, what",
    "    float rounding explains, docs/verify.md); weight.err: worst quantized tensor (decides: --max-weight-error)",
    "  quality vs the bf16 source: layer.err, the layer alone on h; cosine, rel.err: the residual stream end to end",
    "    (grows with depth); decide only with --max-layer-error / --min-cosine",
]
FAITHFULNESS = "faithfulness (the artifact computes what the source computes under MXFP8 rounding)"
QUALITY = "quality (what MXFP8 costs against the bf16 source)"

log = logging.getLogger("porter")


def format_table(rep: Report) -> str:
    lines = [f"porter verify {rep.artifact}", f"  reference {rep.reference}"]
    lines += _integrity_lines(rep) + _exact_lines(rep)
    if rep.layers:
        lines += _layer_lines(rep)
    if len(rep.numerics) > 1:
        lines += _side_by_side(rep)
    for g in rep.generation:
        lines += _generation_lines(rep, g)
    lines.append(f"verdict: {'PASS' if rep.passed else 'FAIL'} — {rep.summary}")
    return "\n".join(lines)


def _integrity_lines(rep: Report) -> list[str]:
    integ = rep.integrity
    if integ is None:
        return []
    if integ.passed:
        return [
            f"integrity: ok ({integ.shards} shard digests, {integ.tensors} tensors, headers, index, scales, config)"
        ]
    return (
        [f"integrity: FAILED ({len(integ.issues)} issue(s); any issue fails)"]
        + [f"  - {i.message}" for i in integ.issues[:SHOWN]]
        + more_line(len(integ.issues), SHOWN, "issue(s)")
    )


def _exact_lines(rep: Report) -> list[str]:
    ex = rep.exact
    if ex is None:
        return []
    q = [t for t in ex.tensors if t.quantized]
    bad = [t for t in ex.tensors if not t.exact]
    head = (
        f"exact bytes ({ex.layout} layout, {ex.rounding or 'no'} scales, {ex.device}, "
        f"{ex.bytes_read / 1e9:.3f} GB read in {ex.seconds:.1f} s): "
    )
    worst = max((t.weight_error for t in q), default=0.0)
    second = (
        f"  weight error (second opinion) max {worst:.4g} "
        f"[{threshold_rule(rep.thresholds, 'max_weight_error')}, {option_name('max_weight_error')}]"
    )
    if not bad and not ex.unmapped_sources:
        return [
            head + f"identical — {len(q)} quantized tensor(s) re-derived, {len(ex.tensors) - len(q)} carried "
            "bit-identical [decides: any differing byte fails]",
            second,
        ]
    lines = [
        head + f"{len(bad)} of {len(ex.tensors)} tensor(s) differ [decides: any differing byte fails]",
        second,
    ]
    lines += [f"  - {t.tensor}: {t.problem or _mismatch(t)}" for t in bad[:SHOWN]]
    lines += more_line(len(bad), SHOWN, "differing tensor(s) (all in the JSON report: exact.tensors)")
    lines += [f"  - source tensor {n}: not in the artifact" for n in ex.unmapped_sources[:SHOWN]]
    lines += more_line(len(ex.unmapped_sources), SHOWN, "source tensor(s) not in the artifact")
    return lines


def _mismatch(t) -> str:
    unit = "32-blocks" if t.quantized else "elements"
    return f"{t.mismatched} of {t.blocks} {unit} differ{experts_text(t)}, first at {t.first_mismatch}"


def _layer_lines(rep: Report) -> list[str]:
    st, th = rep.streaming, rep.thresholds
    rule = lambda name: threshold_rule(th, name).replace(" ", "")
    first = next(iter(rep.numerics.values()), None)
    name = first.numerics if first else "w8a16"
    fs = rep.faithfulness
    lines = [
        f"numerics {name} ({NUMERICS_MEANING[name]}): backend {rep.backend}, {rep.device} {rep.dtype}, "
        f"{'layer-streaming' if st and st.enabled else 'full load'}, "
        f"{sum(rep.prompt_tokens)} prompt token(s) in {len(rep.prompt_tokens)} prompt(s)"
        + (f"; {first.note}" if first and first.note else ""),
        f"{FAITHFULNESS}: decides, within float rounding ({fs.precision}, u = {fs.unit_roundoff:.2g});",
        f"{QUALITY}: {_judged(rep, ('max_layer_error', 'min_cosine'))}",
        f"{'layer':>5}  {'type':<12} {'faith.err':>10} {'faith.lim':>10} {'weight.err':>10} "
        f"{'layer.err':>10} {'cosine':>10} {'rel.err':>9}  status",
        f"{'decides:':<19} {'<=lim':>10} {'':>10} {rule('max_weight_error'):>10} "
        f"{rule('max_layer_error'):>10} {rule('min_cosine'):>10} {'info':>9}",
    ]
    bad = {f.layer for f in rep.failures if f.layer is not None}
    for r in rep.layers:
        mark = "FAIL" if r.layer in bad else "ok"
        if r.layer == rep.failing_layer:
            mark += "  <- first failing layer"
        lines.append(
            f"{r.layer:>5}  {r.kind:<12} {_g(r.faith_error):>10} {r.faith_limit:>10.2g} {r.weight_error:>10.4f} "
            f"{r.layer_error:>10.4f} {r.cosine:>10.6f} {r.rel_error:>9.4f}  {mark}"
        )
    lines += LAYER_LEGEND
    lg = rep.logits
    lines += [
        f"{FAITHFULNESS.split(' (')[0]} of the ends [decides]: embeddings {_g(fs.embeddings_error)} "
        f"[<= {fs.embeddings_limit:.2g}]  final logits {_g(fs.logits_error)} [<= {fs.logits_limit:.2g}] "
        "(relative, the same input to both)",
        f"quality of the final logits vs the bf16 source ({lg.positions} prompt positions; "
        f"{_judged(rep, ('max_kl', 'min_top1', 'min_top5'))}):",
        f"  KL(ref||conv) {lg.kl:.3g} [{threshold_rule(th, 'max_kl')}]"
        f"  top-1 {lg.top1:.1%} [{threshold_rule(th, 'min_top1', True)}]"
        f"  top-5 overlap {lg.top5:.1%} [{threshold_rule(th, 'min_top5', True)}]"
        f"  max|diff| {lg.max_abs_diff:.3g} [info]",
        "  top-1: share of positions with the same argmax token; top-5 overlap: "
        "|top-5(ref) & top-5(conv)| / 5 (a fraction)",
    ]
    return lines


def _g(x: float) -> str:
    """A faithfulness figure: an exact 0 as 0, else three significant digits."""
    return "0" if x == 0 else f"{x:.3g}"


def _judged(rep: Report, names: tuple) -> str:
    """'judged: --max-kl <= 0.1' for the thresholds the user set among `names`, else how to set them."""
    th = rep.thresholds
    set_ = [
        f"{option_name(n)} {threshold_rule(th, n, n in ('min_top1', 'min_top5'))}"
        for n in names
        if th.is_set(n)
    ]
    if set_:
        return "judged: " + ", ".join(set_)
    return "info, not judged (" + " / ".join(option_name(n) for n in names) + " to judge it)"


NUMERICS_MEANING = {
    "w8a16": "MXFP8 weights, activations as given",
    "serving": "MXFP8 weights, MoE input and SwiGLU output as MXFP8, as served",
}


def _side_by_side(rep: Report) -> list[str]:
    """Every run's figures in one column each, with the limit or threshold beside each figure."""
    runs = list(rep.numerics.values())
    width = 30

    def cell(v, th, name, pct=False):
        return (f"{v:.1%}" if pct else f"{v:.4g}") + f" [{threshold_rule(th, name, pct)}]"

    def faith(r):
        worst = max(r.layers, key=lambda x: x.faith_error / x.faith_limit if x.faith_limit else 0.0)
        return f"{_g(worst.faith_error)} [<= {worst.faith_limit:.2g}]"

    rows = [
        ("faith.err (worst layer)", faith),
        (
            "faith. logits",
            lambda r: f"{_g(r.faithfulness.logits_error)} [<= {r.faithfulness.logits_limit:.2g}]",
        ),
        ("KL(ref||conv)", lambda r: cell(r.logits.kl, r.thresholds, "max_kl")),
        ("top-1", lambda r: cell(r.logits.top1, r.thresholds, "min_top1", True)),
        ("top-5 overlap", lambda r: cell(r.logits.top5, r.thresholds, "min_top5", True)),
        (
            "layer.err (max)",
            lambda r: cell(max(x.layer_error for x in r.layers), r.thresholds, "max_layer_error"),
        ),
        ("cosine (min)", lambda r: cell(min(x.cosine for x in r.layers), r.thresholds, "min_cosine")),
        ("rel.err (last layer)", lambda r: f"{r.layers[-1].rel_error:.4g} [info]"),
        ("max|logit diff|", lambda r: f"{r.logits.max_abs_diff:.3g} [info]"),
    ]
    done = [r for r in runs if r.logits is not None and r.layers]
    lines = [
        "numerics side by side (faithfulness [<= its float-rounding limit: decides]; quality vs the bf16 "
        "source [its threshold when set, else info]):",
        f"  {'':<23} " + " ".join(f"{r.numerics + ' (' + r.backend + ')':<{width}}" for r in done),
    ]
    lines += [f"  {label:<23} " + " ".join(f"{fn(r):<{width}}" for r in done) for label, fn in rows]
    lines += [
        f"  {r.numerics}: {NUMERICS_MEANING[r.numerics]}" + (f"; {r.note}" if r.note else "") for r in done
    ]
    return lines


def _generation_lines(rep: Report, g) -> list[str]:
    d, need = g.first_divergence, rep.thresholds.min_matching_tokens
    mean_kl = sum(g.kl) / len(g.kl) if g.kl else 0.0
    rule = f">= {need} matching, --min-matching-tokens" if need else "info; --min-matching-tokens N decides"
    agree = (
        "reference agrees on every token" if d is None else f"reference's choice differs first at token {d}"
    )
    return [
        f"generation, quality ({len(g.converted_tokens)} tokens by the converted model, the bf16 source "
        "teacher-forced):",
        f"  {agree} [{rule}]; mean KL {mean_kl:.3g} [info]",
        f"  converted: {g.converted_text!r}",
        f"  reference argmax: {g.reference_text!r}",
    ]


def write_outputs(rep: Report, report_path, plot_path) -> None:
    if report_path is not None:
        rep.write_json(report_path)
        log.info("verify: JSON report written to %s", report_path)
    if plot_path is not None and rep.layers:
        from porter.commands.verify.plot import write_plot

        write_plot(rep.to_dict(), plot_path)
        log.info("verify: per-layer plot written to %s", plot_path)
