"""The verdict of `porter verify`: thresholds, failures, the report dataclasses, the terminal table.

Threshold defaults and how they were calibrated: docs/verify.md ("Thresholds").
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
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


# The serving numerics (MoE input and SwiGLU output also quantized to MXFP8, as the TRT-LLM kernel serves)
# add activation error to the weight error: looser activation thresholds with --quantize experts, set from
# measurements (docs/verify.md, "Thresholds"); with --quantize all the attention error dominates and the
# "all" defaults keep their margin. Weight error: the same weights, unchanged.
SERVING_DEFAULTS = {
    "experts": {
        "max_layer_error": 0.12,
        "min_cosine": 0.88,
        "max_kl": 0.15,
        "min_top1": 0.45,
        "min_top5": 0.65,
    },
    "all": {},
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


@dataclass
class Failure:
    check: str  # integrity | exact | mapping | weights | layer | cosine | logits | generation
    message: str
    layer: Optional[int] = None
    tensor: Optional[str] = None
    shard: Optional[str] = None
    field: Optional[str] = None
    expert: Optional[int] = None
    value: Optional[float] = None
    threshold: Optional[float] = None
    numerics: Optional[str] = None  # the run (w8a16 | serving) a numeric failure is from


@dataclass
class IntegrityResult:
    passed: bool
    shards: int
    tensors: int
    issues: list  # [Failure]


@dataclass
class TensorCheck:
    """Exact re-derivation of one artifact tensor (all its experts) from the source."""

    tensor: str
    shard: Optional[str]
    layer: Optional[int]
    quantized: bool
    sources: list  # source tensor names it was re-derived from
    units: int = 0  # experts (1 for a plain tensor)
    blocks: int = 0  # 32-blocks (quantized) or elements (carried) compared
    mismatched: int = 0  # blocks (quantized) or elements (carried) that differ
    scale_mismatched: int = 0  # of those blocks, the ones whose scale byte differs
    mismatched_by_expert: dict = field(default_factory=dict)  # expert -> count (stacked experts only)
    first_mismatch: Optional[str] = None
    weight_error: float = 0.0  # worst ||deq(Q) - W|| / ||W|| over experts (0 for carried tensors)
    worst_expert: Optional[int] = None
    problem: Optional[str] = None  # shape/dtype/missing: no comparison possible

    @property
    def exact(self) -> bool:
        return self.problem is None and self.mismatched == 0

    @property
    def worst_label(self) -> str:
        """The tensor, with the expert of its worst weight error when it has experts."""
        return self.tensor + (f"[expert {self.worst_expert}]" if self.worst_expert is not None else "")


@dataclass
class ExactResult:
    passed: bool
    layout: str  # source layout the mapping table recognised
    rounding: Optional[str]
    device: str
    bytes_read: int
    seconds: float
    tensors: list  # [TensorCheck]
    unmapped_sources: list  # source tensors no artifact tensor was derived from


@dataclass
class LayerRow:
    layer: int
    kind: str
    cosine: float
    rel_error: float
    layer_error: float
    weight_error: float
    worst_tensor: Optional[str]
    worst_shard: Optional[str]


@dataclass
class LogitStats:
    kl: float
    top1: float
    top5: float
    max_abs_diff: float
    positions: int


@dataclass
class GenerationRow:
    """Greedy continuation by the converted model, scored by one teacher-forced reference pass.
    Per continuation position j: the reference's KL(ref||conv) and its argmax at the position that
    predicts converted token j; first_divergence = first j where that argmax differs from token j."""

    prompt: str
    converted_tokens: list
    converted_text: str
    reference_argmax: list
    reference_text: str
    kl: list
    top1: list  # 1.0 where reference argmax == converted model argmax at that position (teacher-forced)
    first_divergence: Optional[int]


@dataclass
class StreamingInfo:
    enabled: bool
    reason: str
    artifact_bytes: int
    reference_bytes: int
    generation: str  # how the converted model generated: resident | streaming | skipped (why)


@dataclass
class NumericsRun:
    """One teacher-forced comparison of the converted model, computed with `numerics`, against the reference.
    w8a16: the weights as MXFP8, activations as given; serving: also the MoE input and SwiGLU output
    quantized to MXFP8, as serving engines compute (docs/moe-backends.md, "Serving numerics")."""

    numerics: str
    backend: str  # the MoE backend that computed it
    note: str  # why that backend, when it is not the one asked for ("" otherwise)
    thresholds: Thresholds
    embeddings: Optional[dict] = None
    layers: list = field(default_factory=list)  # [LayerRow]
    logits: Optional[LogitStats] = None


@dataclass
class Report:
    artifact: str
    reference: str
    tokenizer: str
    porter_version: Optional[str]
    backend: str
    device: str
    scope: str
    scale_rounding: Optional[str]
    thresholds: Thresholds
    prompts: list
    max_new_tokens: int
    integrity: Optional[IntegrityResult] = None
    exact: Optional[ExactResult] = None
    streaming: Optional[StreamingInfo] = None
    dtype: Optional[str] = None
    prompt_tokens: list = field(default_factory=list)
    embeddings: Optional[dict] = None
    layers: list = field(default_factory=list)  # [LayerRow]
    logits: Optional[LogitStats] = None
    generation: list = field(default_factory=list)  # [GenerationRow]
    passed: bool = False
    failing_layer: Optional[int] = None
    summary: str = ""
    failures: list = field(default_factory=list)  # [Failure]
    seconds: float = 0.0
    numerics_mode: str = "w8a16"  # --numerics: w8a16 | serving | both
    numerics: dict = field(default_factory=dict)  # {w8a16|serving: NumericsRun}; the first one is also above

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    def to_dict(self) -> dict:
        return _jsonable(
            asdict(self) | {"verdict": self.verdict, "figures": figure_table(self.thresholds, self.numerics)}
        )

    def write_json(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


@dataclass
class VerifyResult:
    """What verify() returns: the concluded report, with its verdict at hand."""

    report: Report

    @property
    def passed(self) -> bool:
        return self.report.passed

    @property
    def failures(self) -> list:  # [Failure]
        return self.report.failures

    @property
    def failing_layer(self) -> Optional[int]:
        return self.report.failing_layer

    def __bool__(self) -> bool:
        return self.passed


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------------
# Judging


def judge_exact(ex: ExactResult, th: Thresholds) -> list[Failure]:
    """Bytes first (any mismatch fails), then the statistical weight error as a second opinion."""
    out = [
        Failure(
            "mapping",
            f"source tensor {n} was not carried into the artifact (no artifact tensor is derived from it)",
            tensor=n,
        )
        for n in ex.unmapped_sources
    ]
    for t in ex.tensors:
        if t.problem:
            out.append(
                Failure(
                    "exact",
                    f"tensor {t.tensor} (shard {t.shard}): {t.problem}",
                    layer=t.layer,
                    tensor=t.tensor,
                    shard=t.shard,
                )
            )
        elif t.mismatched:
            out.append(_mismatch_failure(t))
        if t.quantized and t.weight_error > th.max_weight_error:
            out.append(
                Failure(
                    "weights",
                    f"tensor {t.worst_label} (shard {t.shard}): weight error {t.weight_error:.4g} "
                    f"vs the reference > {th.max_weight_error}",
                    layer=t.layer,
                    tensor=t.tensor,
                    shard=t.shard,
                    expert=t.worst_expert,
                    value=t.weight_error,
                    threshold=th.max_weight_error,
                )
            )
    return out


def experts_text(t: TensorCheck) -> str:
    """' in 8 expert(s) (expert 3: 256, ..., ... and 4 more)': the experts with the most differing blocks."""
    if not t.mismatched_by_expert:
        return ""
    worst = sorted(t.mismatched_by_expert.items(), key=lambda kv: -kv[1])
    return f" in {len(worst)} expert(s) (" + cut_list([f"expert {e}: {n}" for e, n in worst], 4, ", ") + ")"


def _mismatch_failure(t: TensorCheck) -> Failure:
    unit = "32-block(s)" if t.quantized else "element(s)"
    what = f"{t.mismatched} of {t.blocks} {unit} differ from the re-derivation"
    if t.quantized:
        what += f" ({t.scale_mismatched} with a different scale byte)"
    what += experts_text(t)
    first = min(t.mismatched_by_expert) if t.mismatched_by_expert else None
    return Failure(
        "exact",
        f"tensor {t.tensor} (shard {t.shard}): {what}; first at {t.first_mismatch}",
        layer=t.layer,
        tensor=t.tensor,
        shard=t.shard,
        expert=first,
        value=t.mismatched,
    )


def judge_numerics(rep: Report, th: Thresholds) -> list[Failure]:
    """Each numerics run against its own thresholds (`th` for a report without runs), then generation."""
    runs = list(rep.numerics.values()) or [
        NumericsRun("w8a16", rep.backend, "", th, rep.embeddings, rep.layers, rep.logits)
    ]
    out = [f for run in runs for f in judge_run(run, tag=len(runs) > 1 or run.numerics != "w8a16")]
    for g in rep.generation:
        d = g.first_divergence
        if th.min_matching_tokens and d is not None and d < th.min_matching_tokens:
            out.append(
                Failure(
                    "generation",
                    f"the reference's greedy choice differs from the converted model's "
                    f"at generated token {d} < {th.min_matching_tokens}",
                    value=d,
                    threshold=th.min_matching_tokens,
                )
            )
    return out


def judge_run(run: NumericsRun, tag: bool = False) -> list[Failure]:
    """Per-layer and logit failures of one run; `tag`: messages say which numerics they are from."""
    th, out = run.thresholds, []
    pre = f"{run.numerics} numerics: " if tag else ""
    for row in run.layers:
        i = row.layer
        if row.layer_error > th.max_layer_error:
            out.append(
                Failure(
                    "layer",
                    f"{pre}layer {i} ({row.kind}): output error of the layer alone "
                    f"{row.layer_error:.4g} > {th.max_layer_error}",
                    layer=i,
                    value=row.layer_error,
                    threshold=th.max_layer_error,
                    numerics=run.numerics,
                )
            )
        if row.cosine < th.min_cosine:
            out.append(
                Failure(
                    "cosine",
                    f"{pre}layer {i} ({row.kind}): residual-stream cosine {row.cosine:.6f} < {th.min_cosine}",
                    layer=i,
                    value=row.cosine,
                    threshold=th.min_cosine,
                    numerics=run.numerics,
                )
            )
    lg = run.logits
    for value, bad, thr, what in (
        (lg.kl, lg.kl > th.max_kl, th.max_kl, "KL(ref||conv)"),
        (lg.top1, lg.top1 < th.min_top1, th.min_top1, "top-1 agreement"),
        (lg.top5, lg.top5 < th.min_top5, th.min_top5, "top-5 overlap"),
    ):
        if bad:
            out.append(
                Failure(
                    "logits",
                    f"{pre}final logits: {what} {value:.4g} crosses {thr}",
                    value=value,
                    threshold=thr,
                    numerics=run.numerics,
                )
            )
    return out


def cut_list(items: list, keep: int, sep: str) -> str:
    """The first `keep` items joined, and how many were left out ("... and 37 more")."""
    more = len(items) - keep
    return sep.join(map(str, items[:keep])) + (f"{sep}... and {more} more" if more > 0 else "")


def more_line(total: int, shown: int, what: str, indent: str = "  ") -> list[str]:
    """[] when nothing was cut, else one line saying how many of `what` were left out."""
    return [f"{indent}... and {total - shown} more {what}"] if total > shown else []


def conclude(rep: Report, failures: list[Failure]) -> None:
    """Set passed / failing_layer / summary: the first failure of the earliest failing layer leads; when most
    re-derived tensors differ, the summary first says the reference is likely another checkpoint."""
    rep.failures = failures
    rep.passed = not failures
    layers = [f.layer for f in failures if f.layer is not None]
    rep.failing_layer = min(layers) if layers else None
    lead = [f for f in failures if f.layer == rep.failing_layer] or failures
    if not lead:
        rep.summary = "faithful: bytes re-derived exactly, every numeric check within its threshold"
        return
    f = lead[0]
    named = f.layer is not None and f.check not in ("layer", "cosine")  # those messages name it
    rep.summary = (f"layer {f.layer}: " if named else "") + f.message
    if len(failures) > 1:
        rep.summary += f" (and {len(failures) - 1} more failure(s))"
    hint = other_checkpoint_hint(rep.exact, rep.reference)
    if hint:
        rep.summary = f"{hint}; first failure: {rep.summary}"


def other_checkpoint_hint(ex: Optional[ExactResult], reference: str) -> Optional[str]:
    """A faulty conversion or a tampered artifact changes a few tensors; more than half of them differing
    from their re-derivation points at the reference instead (another checkpoint of the same shapes)."""
    if ex is None or not ex.tensors:
        return None
    bad = sum(not t.exact for t in ex.tensors)
    if 2 * bad <= len(ex.tensors):
        return None
    return (
        f"{bad} of {len(ex.tensors)} re-derived tensors differ: the reference {reference} may be a "
        "different checkpoint than the one converted; pass that one with --reference DIR|REPO_ID"
    )
