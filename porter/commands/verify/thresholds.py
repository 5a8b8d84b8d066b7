"""The thresholds of `porter verify` (defaults per scope, allowed ranges, how each rule reads) and the
figures judged against them.

Threshold defaults and how they were calibrated: docs/verify.md ("Thresholds").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from porter.errors import VerifyInputError


@dataclass
class Thresholds:
    """What the user asks of the figures. max_weight_error decides (MXFP8 rounding cannot move a weight
    further: docs/verify.md); the quality thresholds (the cost of MXFP8 against the bf16 source) decide only
    when set — None: reported, not judged. max_* fail above, min_* below. Faithfulness (the converted model
    against the source rounded by verify's own re-derivation) has no threshold here: its limit is float
    rounding (faithfulness.py)."""

    max_weight_error: float = 0.06
    max_layer_error: Optional[float] = None
    min_cosine: Optional[float] = None
    max_kl: Optional[float] = None
    min_top1: Optional[float] = None
    min_top5: Optional[float] = None
    min_matching_tokens: int = 0  # greedy tokens the reference must agree on (0: report only)

    @classmethod
    def build(cls, overrides: Optional[dict] = None) -> "Thresholds":
        t = cls()
        known = {f.name for f in fields(cls)}
        for k, v in (overrides or {}).items():
            if v is None:
                continue
            if k not in known:
                raise VerifyInputError(f"unknown threshold {k!r}; known: {', '.join(sorted(known))}")
            setattr(t, k, int(v) if k == "min_matching_tokens" else float(check_threshold(k, v)))
        return t

    def is_set(self, name: str) -> bool:
        """Whether threshold `name` decides: set (quality), or always (max_weight_error); a
        min_matching_tokens of 0 asks for nothing."""
        v = getattr(self, name)
        return v is not None and not (name == "min_matching_tokens" and v == 0)


# The quality thresholds: unset by default (docs/verify.md, "Faithfulness and quality").
QUALITY = ("max_layer_error", "min_cosine", "max_kl", "min_top1", "min_top5", "min_matching_tokens")

# The values a threshold may take: fractions in [0, 1], cosine in [-1, 1], errors and counts >= 0. NaN
# compares false with everything, so a NaN threshold would pass every check: it is refused like inf.
THRESHOLD_RANGES = {
    "max_weight_error": (0.0, None),
    "max_layer_error": (0.0, None),
    "min_cosine": (-1.0, 1.0),
    "max_kl": (0.0, None),
    "min_top1": (0.0, 1.0),
    "min_top5": (0.0, 1.0),
    "min_matching_tokens": (0, None),
}
FLOAT_THRESHOLDS = tuple(n for n in THRESHOLD_RANGES if n != "min_matching_tokens")  # one --flag each


def threshold_range_text(name: str) -> str:
    lo, hi = THRESHOLD_RANGES[name]
    return f"a finite number >= {lo:g}" if hi is None else f"a number in [{lo:g}, {hi:g}]"


def threshold_help(name: str) -> str:
    """The --help text of a threshold flag: what it bounds, whether it decides by default, its range."""
    what = {
        "max_weight_error": "Largest relative weight error ||deq(Q) - W|| / ||W|| of a quantized tensor "
        "(MXFP8 rounding stays near 3 %). Default 0.06; decides.",
        "max_layer_error": "Quality: largest error of a layer alone against the bf16 source.",
        "min_cosine": "Quality: lowest residual-stream cosine against the bf16 source.",
        "max_kl": "Quality: largest KL(bf16 source || converted) of the final logits (nats per position).",
        "min_top1": "Quality: lowest top-1 agreement with the bf16 source (a fraction).",
        "min_top5": "Quality: lowest top-5 overlap with the bf16 source (a fraction).",
    }[name]
    unset = "" if name == "max_weight_error" else " Default: unset (reported, not judged)."
    return f"{what}{unset} {threshold_range_text(name).capitalize()}."


def check_threshold(name: str, value) -> float:
    """`value` as a number when it is finite and in THRESHOLD_RANGES[name], else VerifyInputError."""
    lo, hi = THRESHOLD_RANGES[name]
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x) or x < lo or (hi is not None and x > hi):
        raise VerifyInputError(f"threshold {name} = {value!r}: want {threshold_range_text(name)}")
    return value


def option_name(threshold: str) -> str:
    return "--" + threshold.replace("_", "-")


def threshold_rule(th: "Thresholds", name: str, percent: bool = False) -> str:
    """'<= 0.08' / '>= 50%' for a threshold that decides (max_* fail above, min_* below), else 'info'."""
    if not th.is_set(name):
        return "info"
    v = getattr(th, name)
    return ("<= " if name.startswith("max_") else ">= ") + (f"{v * 100:g}%" if percent else f"{v:g}")


NUMERICS = ("w8a16", "serving", "both")


def numerics_runs(numerics: str) -> list[str]:
    """The runs of `--numerics`: 'both' -> ['w8a16', 'serving'] (w8a16 first: the primary run)."""
    if numerics not in NUMERICS:
        raise VerifyInputError(f"numerics {numerics!r}: want one of {', '.join(NUMERICS)}")
    return ["w8a16", "serving"] if numerics == "both" else [numerics]


@dataclass(frozen=True)
class Figure:
    """One figure of the report: where it is in the JSON, what it measures, what decides on it, and whether
    it is about faithfulness (the conversion) or quality (the cost of MXFP8 against the bf16 source)."""

    key: str  # path in the JSON report ([] = every element of a list)
    measures: str
    threshold: Optional[str] = None  # the Thresholds field it is compared against
    rule: Optional[str] = None  # how it decides without a threshold; neither: information only
    kind: str = "faithfulness"  # faithfulness | quality


_ALONE = "both fed the same input (the bf16 source's hidden state)"
FIGURES = (
    Figure(
        "integrity.issues",
        "the files against porter.json: shard digests, headers, index, scale bytes, config",
        rule="any issue fails (and stops verify)",
    ),
    Figure(
        "exact.tensors[].mismatched",
        "32-blocks (quantized tensors) or elements (carried tensors) that "
        "differ from the re-derivation from the reference",
        rule="any differing block or element fails",
    ),
    Figure(
        "exact.tensors[].problem",
        "why a tensor could not be compared (no source, shape, dtype)",
        rule="any problem fails",
    ),
    Figure(
        "exact.unmapped_sources",
        "reference tensors no artifact tensor was derived from",
        rule="any unmapped source tensor fails",
    ),
    Figure(
        "exact.tensors[].weight_error",
        "relative weight error ||deq(Q) - W|| / ||W|| of the tensor (its worst expert)",
        "max_weight_error",
    ),
    Figure(
        "layers[].weight_error",
        "the largest weight_error of the layer's quantized tensors",
        "max_weight_error",
    ),
    Figure(
        "layers[].faith_error",
        "the converted layer against the same layer with the source weights rounded by verify's own MXFP8 "
        f"re-derivation, {_ALONE}: ||out_conv - out_rounded|| / ||out_rounded - h||",
        rule="above its layers[].faith_limit (float rounding: faithfulness.limit_basis)",
    ),
    Figure(
        "faithfulness.embeddings_error",
        "the converted model's embedding output against the rounded source's, relative",
        rule="above faithfulness.embeddings_limit",
    ),
    Figure(
        "faithfulness.logits_error",
        f"the converted model's final norm + lm_head against the rounded source's, {_ALONE}, relative",
        rule="above faithfulness.logits_limit",
    ),
    Figure(
        "layers[].cosine",
        "quality: cosine of the residual stream after the layer against the bf16 source, each model fed its "
        "own previous output (end to end)",
        "min_cosine",
        kind="quality",
    ),
    Figure(
        "layers[].rel_error",
        "quality: relative error of the residual stream after the layer against the bf16 source, end to end "
        "(it grows with depth; layer_error names the layer)",
        kind="quality",
    ),
    Figure(
        "layers[].layer_error",
        f"quality: the layer alone against the bf16 source's, {_ALONE}: "
        "||d_conv - d_ref|| / ||d_ref|| of the layer's update",
        "max_layer_error",
        kind="quality",
    ),
    Figure("embeddings", "quality: cosine and relative error of the embedding output", kind="quality"),
    Figure(
        "logits.kl",
        "quality: KL(bf16 source || conv) of the final logits, mean per prompt position (nats)",
        "max_kl",
        kind="quality",
    ),
    Figure(
        "logits.top1",
        "quality: top-1 agreement, the fraction of prompt positions where the bf16 source's and the "
        "converted model's argmax token is the same",
        "min_top1",
        kind="quality",
    ),
    Figure(
        "logits.top5",
        "quality: top-5 overlap, the overlap of the two models' top-5 token sets as a fraction "
        "(|top5(ref) & top5(conv)| / 5), mean over prompt positions",
        "min_top5",
        kind="quality",
    ),
    Figure(
        "logits.max_abs_diff",
        "quality: the largest |logit difference| over prompt positions and vocabulary",
        kind="quality",
    ),
    Figure(
        "generation[].first_divergence",
        "quality: the first generated token where the bf16 source's argmax differs "
        "from the converted model's greedy token (null: none)",
        "min_matching_tokens",
        kind="quality",
    ),
    Figure("generation[].kl", "quality: KL(ref || conv) per generated token", kind="quality"),
    Figure(
        "generation[].top1", "quality: 1.0 where both argmaxes agree, per generated token", kind="quality"
    ),
)


RUN_FIGURES = (
    "layers[].faith_error",
    "faithfulness.embeddings_error",
    "faithfulness.logits_error",
    "layers[].cosine",
    "layers[].rel_error",
    "layers[].layer_error",
    "embeddings",
    "logits.kl",
    "logits.top1",
    "logits.top5",
    "logits.max_abs_diff",
)


def figure_table(th: "Thresholds", runs: Optional[dict] = None) -> dict:
    """FIGURES as the JSON report's `figures`:
    {key: {measures, kind, decides, threshold, option, limit, fails_when}}; with `runs` ({name:
    NumericsRun}), also each run's figures under numerics.<name>."""
    out = _figures(FIGURES, th)
    for name in runs or {}:
        per = [
            Figure(f"numerics.{name}.{f.key}", f"{name} numerics: {f.measures}", f.threshold, f.rule, f.kind)
            for f in FIGURES
            if f.key in RUN_FIGURES
        ]
        out |= _figures(per, th)
    return out


def _figures(figs, th: "Thresholds") -> dict:
    out = {}
    for f in figs:
        d = {"measures": f.measures, "kind": f.kind, "decides": f.rule is not None}
        if f.rule:
            d["fails_when"] = f.rule
        elif f.threshold:
            limit = getattr(th, f.threshold)
            d["decides"] = th.is_set(f.threshold)
            d |= {"threshold": f.threshold, "option": option_name(f.threshold), "limit": limit}
            if d["decides"]:
                d["fails_when"] = ("above " if f.threshold.startswith("max_") else "below ") + f"{limit:g}"
        if not d["decides"]:
            how = " N > 0" if f.threshold == "min_matching_tokens" else ""
            d["fails_when"] = "never: information only" + (
                f" (decides with {option_name(f.threshold)}{how})" if f.threshold else ""
            )
        out[f.key] = d
    return out
