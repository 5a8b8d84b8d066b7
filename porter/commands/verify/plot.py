"""The per-layer agreement picture of `porter verify`: hand-written SVG (no dependency), or PNG when the
path ends in .png and matplotlib is importable.

Left panel: error per decoder layer on a log scale — end-to-end residual rel. error (information only),
the layer's own output error, the weight error — with the layer/weight thresholds dashed. Right panel:
residual-stream cosine as 1 - cosine (log scale) with the cosine threshold. Each dashed line is labelled
with the series it bounds and its value. The first failing layer is marked red. With `--numerics both`,
the serving run adds its layer output error and 1 - cosine (dotted) with its own labelled thresholds.
"""

from __future__ import annotations

import math
from pathlib import Path
from xml.sax.saxutils import escape

SERIES = (
    ("rel_error", "residual rel. error (end to end; info)", "#1f77b4"),
    ("layer_error", "layer output error (layer alone)", "#ff7f0e"),
    ("weight_error", "weight error (max tensor/expert)", "#2ca02c"),
)
COSINE = ("1 - cosine (residual stream)", "#9467bd")
SERVING = (
    ("layer_error", "serving: layer output error", "#d4a017"),
    ("cosine", "serving: 1 - cosine", "#8c564b"),
)
FLOOR = 1e-7
LABEL_GAP = 12  # px between two threshold labels, so lines close together keep readable labels


def second_run(rep: dict):
    """The serving run of a `--numerics both` report (plotted beside the first), else None."""
    runs = rep.get("numerics") or {}
    return runs.get("serving") if len(runs) > 1 and runs.get("serving", {}).get("layers") else None


def threshold_lines(th: dict, serving: dict = None) -> tuple[list, list]:
    """(left panel, right panel) threshold lines: (value, label naming the series it bounds, color);
    `serving`: the serving run's thresholds, lines of their own."""
    left, right = _threshold_lines(th)
    if serving is not None:
        lim = serving["max_layer_error"]
        left.append(
            (lim, f"serving layer output error <= {lim:g} (--max-layer-error, serving)", SERVING[0][2])
        )
        right.append(
            (
                1.0 - serving["min_cosine"],
                f"serving 1 - cosine <= {1.0 - serving['min_cosine']:.3g} (--min-cosine, serving)",
                SERVING[1][2],
            )
        )
    return left, right


def _threshold_lines(th: dict) -> tuple[list, list]:
    left = [
        (
            th["max_layer_error"],
            f"layer output error <= {th['max_layer_error']:g} (--max-layer-error)",
            "#ff7f0e",
        ),
        (
            th["max_weight_error"],
            f"weight error <= {th['max_weight_error']:g} (--max-weight-error)",
            "#2ca02c",
        ),
    ]
    right = [
        (
            1.0 - th["min_cosine"],
            f"1 - cosine <= {1.0 - th['min_cosine']:.3g} (cosine >= {th['min_cosine']:g}, --min-cosine)",
            COSINE[1],
        )
    ]
    return left, right


def png_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plot(rep: dict, path) -> Path:
    path = Path(path)
    if path.suffix.lower() == ".png":
        _write_png(rep, path)
    else:
        path.write_text(svg(rep))
    return path


def numerics_line(rep: dict) -> str:
    runs = list((rep.get("numerics") or {}).values())
    return "numerics: " + (" and ".join(f"{r['numerics']} (backend {r['backend']})" for r in runs) or "w8a16")


def bytes_line(rep: dict) -> str:
    """The exact re-derivation in a few words."""
    ex = rep.get("exact")
    if not ex:
        return "bytes not compared"
    bad = [t for t in ex["tensors"] if t["mismatched"] or t["problem"]]
    return "bytes identical to the re-derivation" if not bad else f"bytes differ in {len(bad)} tensor(s)"


def _log_axis(values):
    vals = [max(v, FLOOR) for v in values if v is not None and math.isfinite(v)] or [FLOOR, 1.0]
    lo, hi = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
    return (lo, hi) if hi > lo else (lo, lo + 1)


def _panel(x0, y0, w, h, layers, series, thresholds, title, fail):
    """SVG elements of one log-y panel. series: [(values, label, color)], thresholds: [(value, label, color)]."""
    out = []
    lo, hi = _log_axis([v for vals, _, _ in series for v in vals] + [t for t, _, _ in thresholds])
    n = max(len(layers), 1)
    px = lambda i: x0 + (w * (i + 0.5) / n)
    py = lambda v: y0 + h - h * (math.log10(max(v, FLOOR)) - lo) / (hi - lo)
    out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="white" stroke="#444"/>')
    out.append(
        f'<text x="{x0 + w / 2}" y="{y0 - 8}" text-anchor="middle" font-size="13">{escape(title)}</text>'
    )
    for e in range(lo, hi + 1):
        y = py(10.0**e)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">1e{e}</text>')
    step = max(1, n // 20)
    for i, layer in enumerate(layers):
        if i % step == 0 or i == n - 1:
            out.append(
                f'<text x="{px(i):.1f}" y="{y0 + h + 14}" text-anchor="middle" font-size="10">{layer}</text>'
            )
    if fail is not None and fail in layers:
        i = layers.index(fail)
        out.append(
            f'<rect x="{px(i) - w / n / 2:.1f}" y="{y0}" width="{w / n:.1f}" height="{h}" '
            f'fill="#d62728" fill-opacity="0.15"/>'
        )
    last = -math.inf
    for t, label, color in sorted(thresholds, key=lambda x: -x[0]):  # top line first
        y = py(t)
        out.append(
            f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="{color}" '
            f'stroke-dasharray="6,4"><title>{escape(label)}</title></line>'
        )
        # above its line (below it at the panel's top edge), and clear of the label before it
        last = max(y - 3 if y - 3 > y0 + LABEL_GAP else y + LABEL_GAP, last + LABEL_GAP)
        out.append(
            f'<text class="threshold" x="{x0 + w - 4}" y="{last:.1f}" text-anchor="end" '
            f'font-size="10" fill="{color}">{escape(label)}</text>'
        )
    for vals, label, color in series:
        pts = " ".join(
            f"{px(i):.1f},{py(v):.1f}" for i, v in enumerate(vals) if v is not None and math.isfinite(v)
        )
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        for i, v in enumerate(vals):
            if v is not None and math.isfinite(v):
                out.append(
                    f'<circle cx="{px(i):.1f}" cy="{py(v):.1f}" r="3" fill="{color}">'
                    f"<title>layer {layers[i]}: {escape(label)} {v:.4g}</title></circle>"
                )
    out.append(
        f'<text x="{x0 + w / 2}" y="{y0 + h + 30}" text-anchor="middle" font-size="11">decoder layer</text>'
    )
    return out


def svg(rep: dict) -> str:
    rows = rep.get("layers", [])
    layers = [r["layer"] for r in rows]
    th = rep["thresholds"]
    fail = rep.get("failing_layer")
    W, H = 980, 440
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
        f'<rect width="{W}" height="{H}" fill="#fafafa"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
        f"porter verify: {escape(Path(rep['artifact']).name)} — {'PASS' if rep['passed'] else 'FAIL'}"
        + (f" (first failing layer {fail})" if fail is not None else "")
        + f"; {bytes_line(rep)}</text>",
    ]
    series = [([r[k] for r in rows], label, color) for k, label, color in SERIES]
    cos = [([1.0 - r["cosine"] for r in rows], *COSINE)]
    sv = second_run(rep)
    left, right = threshold_lines(th, sv and sv["thresholds"])
    if sv:
        series.append(([r["layer_error"] for r in sv["layers"]], SERVING[0][1], SERVING[0][2]))
        cos.append(([1.0 - r["cosine"] for r in sv["layers"]], SERVING[1][1], SERVING[1][2]))
    parts += _panel(60, 60, 520, 280, layers, series, left, "error per layer (log)", fail)
    parts += _panel(660, 60, 290, 280, layers, cos, right, "1 - cosine per layer (log)", fail)
    y = 392
    legend = SERIES + (("",) + COSINE,) + (SERVING if sv else ())
    for i, (_, label, color) in enumerate(legend):
        x = 60 + (i % 4) * 230
        y = 392 + (i // 4) * 16
        parts.append(f'<line x1="{x}" y1="{y}" x2="{x + 20}" y2="{y}" stroke="{color}" stroke-width="3"/>')
        parts.append(f'<text x="{x + 26}" y="{y + 4}" font-size="11">{escape(label)}</text>')
    parts.append(
        f'<text x="60" y="{y + 18}" font-size="10" fill="#555">{escape(numerics_line(rep))}; '
        "dashed: thresholds that decide the verdict (labelled with the series they bound); info: no threshold; "
        f"red band: first failing layer</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _write_png(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rep["layers"]
    layers = [r["layer"] for r in rows]
    th = rep["thresholds"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for k, label, color in SERIES:
        a.semilogy(layers, [max(r[k], FLOOR) for r in rows], "o-", label=label, color=color)
    b.semilogy(layers, [max(1 - r["cosine"], FLOOR) for r in rows], "o-", color=COSINE[1], label=COSINE[0])
    sv = second_run(rep)
    if sv:
        a.semilogy(
            layers,
            [max(r["layer_error"], FLOOR) for r in sv["layers"]],
            "s:",
            color=SERVING[0][2],
            label=SERVING[0][1],
        )
        b.semilogy(
            layers,
            [max(1 - r["cosine"], FLOOR) for r in sv["layers"]],
            "s:",
            color=SERVING[1][2],
            label=SERVING[1][1],
        )
    left, right = threshold_lines(th, sv and sv["thresholds"])
    for ax, lines in ((a, left), (b, right)):
        for value, label, color in lines:
            ax.axhline(max(value, FLOOR), ls="--", color=color, label=label)
    if rep.get("failing_layer") is not None:
        for ax in (a, b):
            ax.axvspan(rep["failing_layer"] - 0.5, rep["failing_layer"] + 0.5, color="#d62728", alpha=0.15)
    for ax in (a, b):
        ax.set_xlabel("decoder layer")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"porter verify: {Path(rep['artifact']).name} — {'PASS' if rep['passed'] else 'FAIL'}; "
        f"{bytes_line(rep)}; {numerics_line(rep)}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
