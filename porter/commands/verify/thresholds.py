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
    """max_* fail above, min_* below. Defaults depend on the artifact's quantize scope: SCOPE_DEFAULTS."""

    max_weight_error: float = 0.06
    max_layer_error: float = 0.08
    min_cosine: float = 0.90
    max_kl: float = 0.10
    min_top1: float = 0.50
    min_top5: float = 0.70
    min_matching_tokens: int = 0  # greedy tokens the reference must agree on (0: report only)

    @classmethod
    def build(
        cls, overrides: Optional[dict] = None, scope: str = "experts", numerics: str = "w8a16"
    ) -> "Thresholds":
        defaults = SCOPE_DEFAULTS.get(scope, {})
        if numerics == "serving":
            defaults = defaults | SERVING_DEFAULTS.get(scope, {})
        t = cls(**defaults)
        known = {f.name for f in fields(cls)}
        for k, v in (overrides or {}).items():
            if v is None:
                continue
            if k not in known:
                raise VerifyInputError(f"unknown threshold {k!r}; known: {', '.join(sorted(known))}")
            setattr(t, k, type(getattr(t, k))(check_threshold(k, v)))
        return t


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


def threshold_range_text(name: str) -> str:
    lo, hi = THRESHOLD_RANGES[name]
    return f"a finite number >= {lo:g}" if hi is None else f"a number in [{lo:g}, {hi:g}]"


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
    """'<= 0.08' / '>= 50%': what passes for threshold `name` (max_* fail above, min_* below)."""
    v = getattr(th, name)
    return ("<= " if name.startswith("max_") else ">= ") + (f"{v * 100:g}%" if percent else f"{v:g}")


# "experts" = the dataclass defaults; "all" also quantizes attention, whose error moves the router input
# (on the tiny random model that flips routes), so activation thresholds are looser; "none" is exact.
SCOPE_DEFAULTS = {
    "experts": {},
    "all": {"max_layer_error": 0.5, "min_cosine": 0.75, "max_kl": 0.3, "min_top1": 0.30, "min_top5": 0.45},
    "none": {
        "max_weight_error": 0.0,
        "max_layer_error": 1e-6,
        "min_cosine": 0.999999,
        "max_kl": 1e-6,
        "min_top1": 1.0,
        "min_top5": 1.0,
    },
}


# The serving numerics (MoE input and SwiGLU output, and with --quantize all every MXFP8 linear's input, also
# quantized to MXFP8, as the engines serve) add activation error to the weight error: looser activation
# thresholds, set from measurements (docs/verify.md, "Thresholds"); with --quantize all only the top-k
# agreements needed room (worst faithful top-1 0.37, top-5 0.475). Weight error: the same weights, unchanged.
SERVING_DEFAULTS = {
    "experts": {
        "max_layer_error": 0.12,
        "min_cosine": 0.88,
        "max_kl": 0.15,
        "min_top1": 0.45,
        "min_top5": 0.65,
    },
    "all": {"min_top1": 0.25, "min_top5": 0.40},
}
NUMERICS = ("w8a16", "serving", "both")


def numerics_runs(numerics: str) -> list[str]:
    """The runs of `--numerics`: 'both' -> ['w8a16', 'serving'] (w8a16 first: the primary run)."""
    if numerics not in NUMERICS:
        raise VerifyInputError(f"numerics {numerics!r}: want one of {', '.join(NUMERICS)}")
    return ["w8a16", "serving"] if numerics == "both" else [numerics]


@dataclass(frozen=True)
class Figure:
    """One figure of the report: where it is in the JSON, what it measures, and what decides on it."""

    key: str  # path in the JSON report ([] = every element of a list)
    measures: str
    threshold: Optional[str] = None  # the Thresholds field it is compared against
    rule: Optional[str] = None  # how it decides without a threshold; neither: information only


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
        "layers[].cosine",
        "cosine of the residual stream after the layer, each model fed its own previous output (end to end)",
        "min_cosine",
    ),
    Figure(
        "layers[].rel_error",
        "relative error of the residual stream after the layer, end to end (it "
        "grows with depth; layer_error names the layer)",
    ),
    Figure(
        "layers[].layer_error",
        "the layer alone, both models fed the reference input: "
        "||d_conv - d_ref|| / ||d_ref|| of the layer's update",
        "max_layer_error",
    ),
    Figure("embeddings", "cosine and relative error of the embedding output"),
    Figure("logits.kl", "KL(ref || conv) of the final logits, mean per prompt position (nats)", "max_kl"),
    Figure(
        "logits.top1",
        "top-1 agreement: the fraction of prompt positions where both models' argmax token is the same",
        "min_top1",
    ),
    Figure(
        "logits.top5",
        "top-5 overlap: the overlap of the two models' top-5 token sets as a fraction "
        "(|top5(ref) & top5(conv)| / 5), mean over prompt positions",
        "min_top5",
    ),
    Figure("logits.max_abs_diff", "the largest |logit difference| over prompt positions and vocabulary"),
    Figure(
        "generation[].first_divergence",
        "the first generated token where the reference's argmax differs "
        "from the converted model's greedy token (null: none)",
        "min_matching_tokens",
    ),
    Figure("generation[].kl", "KL(ref || conv) per generated token"),
    Figure("generation[].top1", "1.0 where both argmaxes agree, per generated token"),
)


RUN_FIGURES = (
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
    {key: {measures, decides, threshold, option, limit, fails_when}}; with `runs` ({name: NumericsRun}),
    also each run's figures under numerics.<name>., against that run's thresholds."""
    out = _figures(FIGURES, th)
    for name, run in (runs or {}).items():
        per = [
            Figure(f"numerics.{name}.{f.key}", f"{name} numerics: {f.measures}", f.threshold, f.rule)
            for f in FIGURES
            if f.key in RUN_FIGURES
        ]
        out |= _figures(per, run.thresholds)
    return out


def _figures(figs, th: "Thresholds") -> dict:
    out = {}
    for f in figs:
        d = {"measures": f.measures, "decides": f.rule is not None}
        if f.rule:
            d["fails_when"] = f.rule
        elif f.threshold:
            limit = getattr(th, f.threshold)
            # min_matching_tokens 0 asks for no matching token: the figure is then reported only
            d["decides"] = not (f.threshold == "min_matching_tokens" and limit == 0)
            d |= {
                "threshold": f.threshold,
                "option": option_name(f.threshold),
                "limit": limit,
                "fails_when": ("above " if f.threshold.startswith("max_") else "below ") + f"{limit:g}",
            }
        if not d["decides"]:
            d["fails_when"] = "never: information only" + (
                f" (decides with {option_name(f.threshold)} N > 0)" if f.threshold else ""
            )
        out[f.key] = d
    return out
