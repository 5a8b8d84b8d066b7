"""The verdict of `porter verify`: failures, the report dataclasses, the judging (thresholds: thresholds.py)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from porter.commands.verify.thresholds import Thresholds, figure_table, option_name


@dataclass
class Failure:
    check: str  # integrity | exact | mapping | weights | faithfulness | layer | cosine | logits | generation
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
    cosine: float  # quality (vs the bf16 source) from here to layer_error
    rel_error: float
    layer_error: float
    weight_error: float
    worst_tensor: Optional[str]
    worst_shard: Optional[str]
    faith_error: float = 0.0  # faithfulness: vs the rounded source, the layer alone (faithfulness.py)
    faith_limit: float = 0.0  # what float rounding explains for this layer


@dataclass
class FaithfulnessStats:
    """The converted model against the source rounded by verify's own MXFP8 re-derivation (rounded.py), each
    piece on the same input; limits from float rounding (faithfulness.py). Per layer: LayerRow.faith_*."""

    precision: str  # the coarsest float format of the computations compared (sets the unit roundoff)
    unit_roundoff: float
    k: int  # rounding points of the limit's derivation
    embeddings_error: float
    embeddings_limit: float
    logits_error: float
    logits_limit: float
    limit_basis: str = (
        "float rounding: K u sqrt(1 + (2/K) ||out|| / ||d||) per layer, K u for the embeddings and the "
        "logits; u the unit roundoff of the coarsest format either computation rounds to (docs/verify.md)"
    )


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
    w8a16: the weights as MXFP8, activations as given; serving: also the MoE input, the SwiGLU output and
    every MXFP8 linear's input quantized to MXFP8, as serving engines compute (docs/moe-backends.md)."""

    numerics: str
    backend: str  # the MoE backend that computed it
    note: str  # why that backend, when it is not the one asked for ("" otherwise)
    thresholds: Thresholds
    embeddings: Optional[dict] = None
    layers: list = field(default_factory=list)  # [LayerRow]
    logits: Optional[LogitStats] = None
    faithfulness: Optional[FaithfulnessStats] = None


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
    faithfulness: Optional[FaithfulnessStats] = None  # the first run's (also in numerics[...])
    quality_judged: list = field(default_factory=list)  # the quality thresholds the user set
    phases: dict = field(default_factory=dict)  # step -> wall seconds (integrity, exact, generation, ...)

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


QUALITY_CHECKS = ("quality", "generation")  # failures of a threshold the user set; the rest: faithfulness


def judge_numerics(rep: Report, th: Thresholds) -> list[Failure]:
    """Each numerics run: faithfulness against its float-rounding limits, quality against the thresholds the
    user set (`th` for a report without runs); then generation."""
    runs = list(rep.numerics.values()) or [
        NumericsRun("w8a16", rep.backend, "", th, rep.embeddings, rep.layers, rep.logits, rep.faithfulness)
    ]
    tag = len(runs) > 1 or runs[0].numerics != "w8a16"
    out = [f for run in runs for f in judge_faithfulness(run, tag)]
    out += [f for run in runs for f in judge_quality(run, tag)]
    for g in rep.generation:
        d = g.first_divergence
        if th.min_matching_tokens and d is not None and d < th.min_matching_tokens:
            out.append(
                Failure(
                    "generation",
                    f"quality: the bf16 source's greedy choice differs from the converted model's "
                    f"at generated token {d} < {th.min_matching_tokens} (--min-matching-tokens)",
                    value=d,
                    threshold=th.min_matching_tokens,
                    field="min_matching_tokens",
                )
            )
    return out


def judge_faithfulness(run: NumericsRun, tag: bool = False) -> list[Failure]:
    """A layer, the embeddings or the logits further from the rounded source than float rounding explains."""
    pre, out = f"{run.numerics} numerics: " if tag else "", []
    for row in run.layers:
        if row.faith_error > row.faith_limit:
            out.append(
                Failure(
                    "faithfulness",
                    f"{pre}layer {row.layer} ({row.kind}): the converted layer differs from the source rounded "
                    f"by verify's re-derivation by {row.faith_error:.3g} of its update (float rounding "
                    f"explains <= {row.faith_limit:.2g}): a layout, parameter or runtime difference",
                    layer=row.layer,
                    value=row.faith_error,
                    threshold=row.faith_limit,
                    numerics=run.numerics,
                )
            )
    fs = run.faithfulness
    for what, err, lim in (
        ("embedding output", fs.embeddings_error, fs.embeddings_limit),
        ("final logits (final norm + lm_head)", fs.logits_error, fs.logits_limit),
    ):
        if err > lim:
            out.append(
                Failure(
                    "faithfulness",
                    f"{pre}{what}: differs from the rounded source's by {err:.3g} relative (float rounding "
                    f"explains <= {lim:.2g})",
                    value=err,
                    threshold=lim,
                    numerics=run.numerics,
                )
            )
    return out


def judge_quality(run: NumericsRun, tag: bool = False) -> list[Failure]:
    """The cost of MXFP8 against the bf16 source, judged only against the thresholds the user set."""
    th, out = run.thresholds, []
    pre = f"{run.numerics} numerics: " if tag else ""

    def fail(name, value, what, layer=None):
        out.append(
            Failure(
                "quality",
                f"{pre}quality: {what} {value:.4g} {'>' if name.startswith('max_') else '<'} "
                f"{getattr(th, name):g} ({option_name(name)})",
                layer=layer,
                value=value,
                threshold=getattr(th, name),
                field=name,
                numerics=run.numerics,
            )
        )

    for row in run.layers:
        where = f"layer {row.layer} ({row.kind})"
        if th.is_set("max_layer_error") and row.layer_error > th.max_layer_error:
            fail(
                "max_layer_error",
                row.layer_error,
                f"{where}: error of the layer alone vs the bf16 source",
                row.layer,
            )
        if th.is_set("min_cosine") and row.cosine < th.min_cosine:
            fail("min_cosine", row.cosine, f"{where}: residual-stream cosine vs the bf16 source", row.layer)
    lg = run.logits
    for name, value, bad, what in (
        ("max_kl", lg.kl, lambda v, t: v > t, "final logits: KL(bf16 source||conv)"),
        ("min_top1", lg.top1, lambda v, t: v < t, "final logits: top-1 agreement"),
        ("min_top5", lg.top5, lambda v, t: v < t, "final logits: top-5 overlap"),
    ):
        if th.is_set(name) and bad(value, getattr(th, name)):
            fail(name, value, what)
    return out


def worst_faithfulness(rep: Report) -> float:
    """The largest faith_error / limit over every layer, embeddings and logits of every run (0: all exact)."""
    runs = list(rep.numerics.values()) or [
        NumericsRun("w8a16", rep.backend, "", rep.thresholds, None, rep.layers, rep.logits, rep.faithfulness)
    ]
    ratios = [0.0]
    for run in runs:
        ratios += [r.faith_error / r.faith_limit for r in run.layers if r.faith_limit > 0]
        fs = run.faithfulness
        if fs is not None:
            ratios += [fs.embeddings_error / fs.embeddings_limit, fs.logits_error / fs.logits_limit]
    return max(ratios)


def cut_list(items: list, keep: int, sep: str) -> str:
    """The first `keep` items joined, and how many were left out ("... and 37 more")."""
    more = len(items) - keep
    return sep.join(map(str, items[:keep])) + (f"{sep}... and {more} more" if more > 0 else "")


def more_line(total: int, shown: int, what: str, indent: str = "  ") -> list[str]:
    """[] when nothing was cut, else one line saying how many of `what` were left out."""
    return [f"{indent}... and {total - shown} more {what}"] if total > shown else []


def conclude(rep: Report, failures: list[Failure]) -> None:
    """Set passed / failing_layer / summary. Faithfulness failures lead (the first one of the earliest
    failing layer), then quality ones; when most re-derived tensors differ, the summary first says the
    reference is likely another checkpoint."""
    rep.failures = failures
    rep.passed = not failures
    faithful = [f for f in failures if f.check not in QUALITY_CHECKS]
    pool = faithful or failures
    layers = [f.layer for f in pool if f.layer is not None]
    rep.failing_layer = min(layers) if layers else None
    lead = [f for f in pool if f.layer == rep.failing_layer] or pool
    judged = ", ".join(option_name(n) for n in rep.quality_judged)
    quality = f"quality within your thresholds ({judged})" if judged else "quality reported, not judged"
    if not lead:
        rep.summary = f"faithful: bytes identical to verify's re-derivation{_numbers_text(rep)}; {quality}"
        return
    if not faithful:  # faithful, and a quality threshold the user set is crossed: say both
        f = lead[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        rep.summary = f"{f.message}{more}; faithful otherwise: bytes identical{_numbers_text(rep)}"
        return
    f = lead[0]
    named = f.layer is not None and f.check not in ("faithfulness", "quality")  # those messages name it
    rep.summary = "not faithful: " + (f"layer {f.layer}: " if named else "") + f.message
    if len(failures) > 1:
        rep.summary += f" (and {len(failures) - 1} more failure(s))"
    hint = other_checkpoint_hint(rep.exact, rep.reference)
    if hint:
        rep.summary = f"{hint}; first failure: {rep.summary}"


def _numbers_text(rep: Report) -> str:
    if not rep.layers:
        return ""
    return (
        "; every layer, the embeddings and the logits within float rounding of the rounded source "
        f"(worst {worst_faithfulness(rep):.2g} of its limit)"
    )


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
