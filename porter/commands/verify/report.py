"""Terminal table of a `porter verify` report, and the optional JSON / plot outputs."""
from __future__ import annotations

import logging

from porter.commands.verify.verdict import Report

log = logging.getLogger("porter")


def format_table(rep: Report) -> str:
    lines = [f"porter verify {rep.artifact}", f"  reference {rep.reference}"]
    lines += _integrity_lines(rep) + _exact_lines(rep)
    if rep.layers:
        lines += _layer_lines(rep)
    for g in rep.generation:
        lines += _generation_lines(g)
    lines.append(f"verdict: {'PASS' if rep.passed else 'FAIL'} — {rep.summary}")
    return "\n".join(lines)


def _integrity_lines(rep: Report) -> list[str]:
    integ = rep.integrity
    if integ is None:
        return []
    if integ.passed:
        return [f"integrity: ok ({integ.shards} shard digests, {integ.tensors} tensors, headers, index, scales, config)"]
    return [f"integrity: FAILED ({len(integ.issues)} issue(s))"] + [f"  - {i.message}" for i in integ.issues[:20]]


def _exact_lines(rep: Report) -> list[str]:
    ex = rep.exact
    if ex is None:
        return []
    q = [t for t in ex.tensors if t.quantized]
    bad = [t for t in ex.tensors if not t.exact]
    head = (f"exact bytes ({ex.layout} layout, {ex.rounding or 'no'} scales, {ex.device}, "
            f"{ex.bytes_read / 1e9:.3f} GB read in {ex.seconds:.1f} s): ")
    if not bad and not ex.unmapped_sources:
        worst = max((t.weight_error for t in q), default=0.0)
        return [head + f"identical — {len(q)} quantized tensor(s) re-derived, {len(ex.tensors) - len(q)} carried "
                f"bit-identical; weight error (second opinion) max {worst:.4g}"]
    lines = [head + f"{len(bad)} tensor(s) differ"]
    lines += [f"  - {t.tensor}: {t.problem or _mismatch(t)}" for t in bad[:20]]
    lines += [f"  - source tensor {n}: not in the artifact" for n in ex.unmapped_sources[:20]]
    return lines


def _mismatch(t) -> str:
    unit = "32-blocks" if t.quantized else "elements"
    experts = f" in {len(t.mismatched_by_expert)} expert(s)" if t.mismatched_by_expert else ""
    return f"{t.mismatched} of {t.blocks} {unit} differ{experts}, first at {t.first_mismatch}"


def _layer_lines(rep: Report) -> list[str]:
    st, th = rep.streaming, rep.thresholds
    lines = [f"numerics: backend {rep.backend}, {rep.device} {rep.dtype}, "
             f"{'layer-streaming' if st and st.enabled else 'full load'}, "
             f"{sum(rep.prompt_tokens)} prompt token(s) in {len(rep.prompt_tokens)} prompt(s)",
             f"{'layer':>5}  {'type':<12} {'cosine':>10} {'rel.err':>9} {'layer.err':>10} {'weight.err':>10}  status",
             f"{'':>5}  {'':<12} {'>=' + str(th.min_cosine):>10} {'':>9} "
             f"{'<=' + str(th.max_layer_error):>10} {'<=' + str(th.max_weight_error):>10}"]
    bad = {f.layer for f in rep.failures if f.layer is not None}
    for r in rep.layers:
        mark = "FAIL" if r.layer in bad else "ok"
        if r.layer == rep.failing_layer:
            mark += "  <- first failing layer"
        lines.append(f"{r.layer:>5}  {r.kind:<12} {r.cosine:>10.6f} {r.rel_error:>9.4f} "
                     f"{r.layer_error:>10.4f} {r.weight_error:>10.4f}  {mark}")
    lg = rep.logits
    lines.append(f"logits ({lg.positions} prompt positions): KL(ref||conv) {lg.kl:.3g}  top-1 {lg.top1:.1%}  "
                 f"top-5 {lg.top5:.1%}  max|diff| {lg.max_abs_diff:.3g}")
    return lines


def _generation_lines(g) -> list[str]:
    d = g.first_divergence
    mean_kl = sum(g.kl) / len(g.kl) if g.kl else 0.0
    return [f"generation ({len(g.converted_tokens)} tokens by the converted model, reference teacher-forced): "
            + ("reference agrees on every token" if d is None else f"reference's choice differs first at token {d}")
            + f"; mean KL {mean_kl:.3g}",
            f"  converted: {g.converted_text!r}",
            f"  reference argmax: {g.reference_text!r}"]


def write_outputs(rep: Report, report_path, plot_path) -> None:
    if report_path is not None:
        rep.write_json(report_path)
        log.info("verify: JSON report written to %s", report_path)
    if plot_path is not None and rep.layers:
        from porter.commands.verify.plot import write_plot
        write_plot(rep.to_dict(), plot_path)
        log.info("verify: per-layer plot written to %s", plot_path)
