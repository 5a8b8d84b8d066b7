"""The per-layer picture of `porter verify`: hand-written SVG (no dependency), or PNG when the path ends in
.png and matplotlib is importable. Both draw the panels `panels()` describes.

One panel per figure, so that a panel with a dashed line holds only the series that line bounds:
- faithfulness (decides): each layer's faith_error against its float-rounding limit (a dashed step line);
- weight error (decides: --max-weight-error);
- quality against the bf16 source, decides only with the threshold the user set (dashed when set): the layer
  alone (--max-layer-error), 1 - cosine of the residual stream (--min-cosine);
- information only, no dashed line: the residual stream's end-to-end relative error.
Log y axes; an exact 0 (a faithful layer on the CPU) has its own row under the axis, labelled "0 (exact)".
Threshold labels sit in each panel's header beside a dashed sample, never on a line. A FAIL picture lists
the failures under the title, draws every point past its limit as a red ring and bands the first failing
layer. With `--numerics both` the serving run's series are dotted, with their own limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from xml.sax.saxutils import escape

RED = "#d62728"
SERVING_DASH = "2,3"  # the serving run's series: dotted
THRESHOLD_DASH = "6,4"
SHOWN_FAILURES = 4  # failure lines under the title before "... and N more"
FAILURE_CHARS = 160  # a failure line's characters that fit the picture's width (11 px sans-serif)


@dataclass
class Series:
    key: str  # the LayerRow field (or "1-cosine")
    label: str
    color: str
    values: list  # per layer; None where the figure does not exist
    limits: Optional[list] = None  # per layer: the bound that decides (None: the series is information only)
    serving: bool = False


@dataclass
class Threshold:
    label: str
    color: str
    values: list  # per layer (a constant threshold repeats its value)
    serving: bool = False


@dataclass
class Panel:
    name: str
    title: str
    series: list
    thresholds: list = field(default_factory=list)

    @property
    def decides(self) -> bool:
        return bool(self.thresholds)


def second_run(rep: dict):
    """The serving run of a `--numerics both` report (plotted beside the first), else None."""
    runs = rep.get("numerics") or {}
    return runs.get("serving") if len(runs) > 1 and runs.get("serving", {}).get("layers") else None


def panels(rep: dict) -> list[Panel]:
    """The picture's panels, from the JSON report: what each draws and what bounds it."""
    rows, th = rep.get("layers", []), rep["thresholds"]
    sv = second_run(rep)
    runs = [(rows, False)] + ([(sv["layers"], True)] if sv else [])
    tag = lambda serving, text: ("serving: " if serving else "") + text
    faith = Panel("faithfulness", "faithfulness: vs the rounded source, layer alone (decides)", [])
    for r, s in runs:
        lim = [x["faith_limit"] for x in r]
        faith.series.append(
            Series(
                "faith_error",
                tag(s, "faith.err"),
                "#8c564b" if s else "#1f77b4",
                [x["faith_error"] for x in r],
                lim,
                serving=s,
            )
        )
        faith.thresholds.append(
            Threshold(tag(s, "limit: float rounding"), "#8c564b" if s else "#1f77b4", lim, s)
        )
    weight = Panel(
        "weights",
        "weight error (decides)",
        [
            Series(
                "weight_error",
                "weight.err (worst tensor)",
                "#2ca02c",
                [x["weight_error"] for x in rows],
                [th["max_weight_error"]] * len(rows),
            )
        ],
        [
            Threshold(
                f"<= {th['max_weight_error']:g} (--max-weight-error)",
                "#2ca02c",
                [th["max_weight_error"]] * len(rows),
            )
        ],
    )
    out = [faith, weight]
    for key, name, title, option, upper in (
        ("layer_error", "layer_error", "quality: layer alone vs bf16", "max_layer_error", True),
        ("1-cosine", "cosine", "quality: 1 - cosine, end to end", "min_cosine", False),
    ):
        limit = th.get(option)
        p = Panel(name, title + (" (decides)" if limit is not None else " (info)"), [])
        for r, s in runs:
            vals = [x[key] if key != "1-cosine" else 1.0 - x["cosine"] for x in r]
            bound = None if limit is None else [limit if upper else 1.0 - limit] * len(r)
            p.series.append(
                Series(
                    key,
                    tag(s, "1 - cosine" if key == "1-cosine" else "layer.err"),
                    "#d4a017" if s else "#ff7f0e",
                    vals,
                    bound,
                    serving=s,
                )
            )
        if limit is not None:
            shown = f"<= {limit:g}" if upper else f"<= {1.0 - limit:.3g} (cosine >= {limit:g})"
            p.thresholds.append(
                Threshold(
                    f"{shown} ({'--' + option.replace('_', '-')})",
                    "#ff7f0e",
                    [limit if upper else 1.0 - limit] * len(rows),
                )
            )
        out.append(p)
    info = Panel(
        "rel_error",
        "quality: rel. error, end to end (info)",
        [
            Series(
                "rel_error",
                tag(s, "rel.err"),
                "#7f7f7f" if not s else "#bcbd22",
                [x["rel_error"] for x in r],
                serving=s,
            )
            for r, s in runs
        ],
    )
    return out + [info]


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


def failure_lines(rep: dict) -> list[str]:
    """What failed, one line each (cut after SHOWN_FAILURES)."""
    fails = rep.get("failures", [])
    lines = [f["message"] for f in fails[:SHOWN_FAILURES]]
    if len(fails) > SHOWN_FAILURES:
        lines.append(
            f"... and {len(fails) - SHOWN_FAILURES} more failure(s) (the JSON report lists them all)"
        )
    return lines


def crosses(s: Series, i: int) -> bool:
    """Whether point i is past its limit (every series fails above: 1 - cosine above 1 - --min-cosine)."""
    v, lim = s.values[i], None if s.limits is None else s.limits[i]
    return v is not None and lim is not None and v > lim


# ---------------------------------------------------------------------------------------------------
# SVG

FONT = 10  # px: threshold labels, axis labels
ZERO_ROW = 18  # px under the log axis where exact zeros are drawn


class _Axis:
    """A log-y axis over [10^lo, 10^hi] inside (y0, y0 + h), and a row under it for exact zeros."""

    def __init__(self, values, y0: float, h: float):
        pos = [v for v in values if v is not None and math.isfinite(v) and v > 0]
        lo = math.floor(math.log10(min(pos))) if pos else -1
        hi = math.ceil(math.log10(max(pos))) if pos else 0
        self.lo, self.hi = lo, hi if hi > lo else lo + 1
        self.y0, self.h = y0, h - ZERO_ROW  # the log part
        self.zero_y = y0 + h - ZERO_ROW / 2

    def y(self, v: float) -> float:
        if v == 0:
            return self.zero_y
        if not math.isfinite(v):
            return self.y0
        return self.y0 + self.h - self.h * (math.log10(v) - self.lo) / (self.hi - self.lo)


def _panel_svg(p: Panel, x0: float, y0: float, w: float, h: float, layers: list, fail_layer) -> list[str]:
    out = [f'<g class="panel" data-name="{p.name}" data-decides="{str(p.decides).lower()}">']
    values = [v for s in p.series for v in s.values] + [v for t in p.thresholds for v in t.values]
    ax = _Axis(values, y0, h)
    n = max(len(layers), 1)
    px = lambda i: x0 + w * (i + 0.5) / n
    failed = any(crosses(s, i) for s in p.series for i in range(len(s.values)))
    out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="white" stroke="#444"/>')
    title = escape(p.title + (" — FAIL" if failed else ""))
    out.append(
        f'<text class="panel-title" x="{x0}" y="{y0 - 32}" font-size="11" font-weight="bold" '
        f'fill="{RED if failed else "#222"}">{title}</text>'
    )
    out += _legend(p, x0, y0 - 18, w)
    for e in range(ax.lo, ax.hi + 1):  # decades
        y = ax.y(10.0**e)
        out.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="{FONT}">1e{e}</text>')
    zl = y0 + h - ZERO_ROW
    out.append(
        f'<line x1="{x0}" y1="{zl:.1f}" x2="{x0 + w}" y2="{zl:.1f}" stroke="#444" stroke-dasharray="1,2"/>'
    )
    out.append(
        f'<text class="zero-axis" x="{x0 - 4}" y="{ax.zero_y + 3:.1f}" text-anchor="end" '
        f'font-size="{FONT}">0 (exact)</text>'
    )
    step = max(1, math.ceil(n / max(1, w // 26)))  # a label per ~26 px at most
    for i, layer in enumerate(layers):
        if i % step == 0 or (i == n - 1 and i % step > step // 2):  # the last one when it has room
            out.append(
                f'<text x="{px(i):.1f}" y="{y0 + h + 12}" text-anchor="middle" font-size="{FONT}">{layer}</text>'
            )
    if fail_layer is not None and fail_layer in layers:
        i = layers.index(fail_layer)
        out.append(
            f'<rect class="failing-layer" x="{px(i) - w / n / 2:.1f}" y="{y0}" width="{w / n:.1f}" '
            f'height="{h}" fill="{RED}" fill-opacity="0.12"/>'
        )
    for t in p.thresholds:
        pts = _steps([ax.y(v) for v in t.values], x0, w)
        out.append(
            f'<polyline class="threshold-line" points="{pts}" fill="none" stroke="{t.color}" '
            f'stroke-dasharray="{THRESHOLD_DASH}"><title>{escape(t.label)}</title></polyline>'
        )
    for s in p.series:
        role = "decides" if s.limits is not None else "info"
        dash = f' stroke-dasharray="{SERVING_DASH}"' if s.serving else ""
        pts = " ".join(f"{px(i):.1f},{ax.y(v):.1f}" for i, v in enumerate(s.values) if v is not None)
        out.append(
            f'<polyline class="series" data-series="{s.key}" data-role="{role}" points="{pts}" fill="none" '
            f'stroke="{s.color}" stroke-width="2"{dash}/>'
        )
        for i, v in enumerate(s.values):
            if v is None:
                continue
            bad = crosses(s, i)
            ring = ' class="fail" stroke-width="2" r="5"' if bad else ' r="3"'
            fill = "white" if v == 0 else s.color  # an exact zero: a hollow marker on the zero row
            shown = "0 (exact)" if v == 0 else f"{v:.4g}"
            out.append(
                f'<circle cx="{px(i):.1f}" cy="{ax.y(v):.1f}" fill="{fill}"{ring} data-value="{v!r}" '
                f'data-series="{s.key}" data-layer="{layers[i]}" data-serving="{str(s.serving).lower()}" '
                f'stroke="{RED if bad else s.color}"><title>layer {layers[i]}: {escape(s.label)} {shown}'
                f"{' — past its limit' if bad else ''}</title></circle>"
            )
    out.append(
        f'<text x="{x0 + w / 2}" y="{y0 + h + 26}" text-anchor="middle" font-size="11">decoder layer</text>'
    )
    out.append("</g>")
    return out


def _steps(ys: list, x0: float, w: float) -> str:
    """A per-layer value as a step line across each layer's slot."""
    n = max(len(ys), 1)
    pts = []
    for i, y in enumerate(ys):
        pts += [f"{x0 + w * i / n:.1f},{y:.1f}", f"{x0 + w * (i + 1) / n:.1f},{y:.1f}"]
    return " ".join(pts)


def _legend(p: Panel, x: float, y: float, w: float) -> list[str]:
    """The panel's header row: each series (solid, dotted for serving) and each threshold (dashed) with its
    label; above the plot area, so no line ever crosses a label."""
    out, cx = [], x
    items = [(s.label, s.color, SERVING_DASH if s.serving else None, "series") for s in p.series]
    items += [(t.label, t.color, THRESHOLD_DASH, "threshold") for t in p.thresholds]
    for label, color, dash, kind in items:
        width = 22 + 5.6 * len(label) + 12
        if cx > x and cx + width > x + w + 40:  # wrap: the next row (a header has room for two)
            cx, y = x, y + 12
        d = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line class="legend-{kind}" x1="{cx:.1f}" y1="{y - 3:.1f}" x2="{cx + 18:.1f}" y2="{y - 3:.1f}" '
            f'stroke="{color}" stroke-width="2"{d}/>'
        )
        cls = ' class="threshold"' if kind == "threshold" else ""
        ink = color if kind == "threshold" else "#222"
        out.append(
            f'<text{cls} x="{cx + 22:.1f}" y="{y:.1f}" font-size="{FONT}" fill="{ink}">{escape(label)}</text>'
        )
        cx += width
    return out


def svg(rep: dict) -> str:
    rows = rep.get("layers", [])
    layers = [r["layer"] for r in rows]
    fail = rep.get("failing_layer")
    verdict = "PASS" if rep["passed"] else "FAIL"
    lines = [] if rep["passed"] else failure_lines(rep)
    top = 36 + 14 * len(lines)  # the panels' headers start under the failure lines
    W, ph, gap = 980, 190, 78
    H = top + 2 * (ph + gap) + 44
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
        f'<rect width="{W}" height="{H}" fill="#fafafa"/>',
        f'<text class="verdict" x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold" '
        f'fill="{"#222" if rep["passed"] else RED}">'
        f"porter verify: {escape(Path(rep['artifact']).name)} — {verdict}"
        + (f" (first failing layer {fail})" if fail is not None else "")
        + f"; {bytes_line(rep)}</text>",
    ]
    for k, text in enumerate(lines):  # cut to the picture's width; the whole message in its tooltip
        shown = text if len(text) <= FAILURE_CHARS else text[: FAILURE_CHARS - 1] + "…"
        parts.append(
            f'<text class="failure" x="20" y="{42 + 14 * k}" font-size="11" fill="{RED}">'
            f"<title>{escape(text)}</title>{escape(shown)}</text>"
        )
    ps = panels(rep)
    y1 = top + 48
    slots = [(60, y1, 560), (700, y1, 260)] + [(60 + 320 * k, y1 + ph + gap, 260) for k in range(3)]
    for p, (x0, y0, w) in zip(ps, slots):
        parts += _panel_svg(p, x0, y0, w, ph, layers, fail)
    notes = (
        numerics_line(rep)
        + "; dashed: the limit or threshold that decides (a panel without one: information "
        "only); dotted: the serving run",
        "red ring: past its limit; red band: the first failing layer; 0 (exact): no difference at all, on its own "
        "row under the log axis",
    )
    for k, text in enumerate(notes):
        parts.append(
            f'<text class="note" x="20" y="{H - 24 + 13 * k}" font-size="10" fill="#555">{escape(text)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------
# PNG (matplotlib), the same panels


def _write_png(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in rep["layers"]]
    ps = panels(rep)
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    axes = list(axes.flat)
    axes[2].axis("off")
    for p, ax in zip(ps, [axes[0], axes[1], axes[3], axes[4], axes[5]]):
        for s in p.series:
            pos = [(x, v) for x, v in zip(layers, s.values) if v is not None]
            ax.plot(
                [x for x, _ in pos],
                [v if v > 0 else math.nan for _, v in pos],
                "o" + (":" if s.serving else "-"),
                color=s.color,
                label=s.label,
            )
            zeros = [x for x, v in pos if v == 0]
            if zeros:  # exact zeros: hollow markers on the axis' bottom edge, labelled
                ax.plot(
                    zeros,
                    [0.0] * len(zeros),
                    "o",
                    mfc="white",
                    color=s.color,
                    clip_on=False,
                    transform=ax.get_xaxis_transform(),
                    label=f"{s.label}: 0 (exact)",
                )
            bad = [(x, v) for i, (x, v) in enumerate(zip(layers, s.values)) if crosses(s, i)]
            if bad:
                ax.plot([x for x, _ in bad], [v for _, v in bad], "o", mfc="none", mec=RED, ms=10)
        for t in p.thresholds:
            ax.step(layers, t.values, where="mid", ls="--", color=t.color, label=t.label)
        ax.set_yscale("log")
        ax.set_title(p.title, fontsize=9)
        ax.set_xlabel("decoder layer")
        ax.legend(fontsize=7)
        if rep.get("failing_layer") is not None:
            ax.axvspan(rep["failing_layer"] - 0.5, rep["failing_layer"] + 0.5, color=RED, alpha=0.12)
    head = f"porter verify: {Path(rep['artifact']).name} — {'PASS' if rep['passed'] else 'FAIL'}; {bytes_line(rep)}"
    fig.suptitle("\n".join([head] + ([] if rep["passed"] else failure_lines(rep))), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
