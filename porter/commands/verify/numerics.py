"""Step 3 of `porter verify`: the converted model, the rounded reference and the bf16 reference through the
same runtime, layer by layer.

All models see the same token sequences (each prompt, extended by the converted model's greedy
continuation when there is one: generation.py). Per decoder layer, over the prompt positions:
- faithfulness (decides): the converted layer and the same layer of the rounded reference (the source
  weights rounded by verify's own MXFP8 re-derivation: rounded.py), both fed the bf16 reference's input:
  `faith_error` against its float-rounding `faith_limit` (faithfulness.py);
- quality, against the bf16 reference: `cosine`, `rel_error` of the residual stream, each model fed its
  own previous output (end to end: errors accumulate over depth), and `layer_error`, the layer alone, both
  fed the reference input: ||d_conv - d_ref|| / ||d_ref|| for the layer's update d = layer(h) - h.
Final logits over the prompt positions: faithfulness of the final norm + lm_head on the same input; quality
KL(ref || conv) (mean per position, nats), top-1 agreement, top-5 overlap, max |logit difference|. The
logits at the continuation positions are handed back for the teacher-forced scoring of the continuation.

Several numerics runs (`--numerics both`) share the layer loop: per layer, the bf16 reference's layer runs
once, then per run the converted and the rounded reference's layers with that run's numerics
(runtime.set_numerics: per-call attributes, no weight read again), each run on its own end-to-end stream.

The first layer of each kind (dense / MoE) is timed as it runs and the whole pass projected from it (reads
and compute: the estimate before the pass counts the reads only).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from porter.commands.verify import faithfulness as fa
from porter.commands.verify.verdict import FaithfulnessStats, LogitStats

log = logging.getLogger("porter")


class Acc:
    """Running sums for cosine / relative error over many tensors (float64)."""

    def __init__(self):
        self.dot = self.aa = self.bb = self.dd = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:  # a: converted, b: reference
        a, b = a.double().flatten(), b.double().flatten()
        self.dot += float(a @ b)
        self.aa += float(a @ a)
        self.bb += float(b @ b)
        self.dd += float((a - b) @ (a - b))

    @property
    def cosine(self) -> float:
        den = math.sqrt(self.aa * self.bb)
        return self.dot / den if den > 0 else (1.0 if self.dd == 0 else 0.0)

    @property
    def rel(self) -> float:
        return math.sqrt(self.dd / self.bb) if self.bb > 0 else (0.0 if self.dd == 0 else math.inf)


@dataclass
class LayerStats:
    cosine: float
    rel_error: float
    layer_error: float
    faith_error: float
    faith_limit: float


@dataclass
class PassResult:
    embeddings: dict
    layers: list  # [LayerStats] per decoder layer
    logits: LogitStats
    tails: list  # per sequence: (reference logits, converted logits) [n, V] at positions P-1 .. T-1
    faithfulness: FaithfulnessStats


def compare_models(
    ref, conv, seqs: list, prompt_lens: list, progress: bool = False, rounded=None, runs: tuple = (None,)
) -> list[PassResult]:
    """ref: the bf16 reference; conv: the converted model; rounded: the rounded reference (None: ref, for an
    artifact with nothing quantized). seqs: LongTensor [1, T] per sequence; prompt_lens: P per sequence
    (stats over positions < P). runs: the numerics of each run (runtime.set_numerics: "serving", or None for
    the backend's own), all in one layer loop: each layer is read once, the bf16 reference's computed once,
    the converted and rounded layers once per run, each run with its own end-to-end stream. One PassResult
    per run, what a pass of that run alone gives. The models are left in the last run's numerics."""
    rounded = ref if rounded is None else rounded
    switch = _switcher(conv, None if rounded is ref else rounded)
    with torch.inference_mode():
        h_ref, h_conv = [ref.embed(x) for x in seqs], [conv.embed(x) for x in seqs]
        emb, emb_gap = Acc(), fa.Gap()  # embeddings: no numerics apply, the same in every run
        for a, b, x, p in zip(h_conv, h_ref, seqs, prompt_lens):
            emb.add(a[:, :p], b[:, :p])
            emb_gap.add(a[:, :p], rounded.embed(x)[:, :p])
        chains = [list(h_conv) for _ in runs]  # each run's converted residual stream, end to end
        layers, precisions, clock = [[] for _ in runs], {conv.dtype}, _Projection(conv.cfg, len(runs))
        models = {id(m): m for m in (ref, conv, rounded)}.values()  # rounded may be ref
        streamed = [m for m in models if hasattr(m.layers, "free")]  # LazyLayers
        for i in tqdm(range(ref.cfg.num_hidden_layers), desc="verify layers", disable=not progress):
            t0 = time.perf_counter()
            lr = ref.layers[i]  # first: a layer-streamed verify compares the layer's bytes as it is built
            lc, lrr = conv.layers[i], rounded.layers[i]
            fmt = fa.precision(conv.dtype, fa.moe_backend(lc))
            precisions.add(fmt)
            r = [lr(h, _positions(h)) for h in h_ref]  # the bf16 reference: no numerics, once for every run
            for run, stats, h in zip(runs, layers, chains):
                switch(run)
                stats.append(_layer(r, lc, lr, lrr, h_ref, h, prompt_lens, fmt))
            h_ref[:] = r
            del lr, lc, lrr
            for m in streamed:  # before the next layer is read and checked, not beside it
                m.layers.free()
            clock.done(i, time.perf_counter() - t0)
        for m in streamed:
            m.layers.release()
        ref_logits = [ref.final(a)[0] for a in h_ref]  # [T, V] per sequence, every run's reference
        out = []
        for run, stats, h in zip(runs, layers, chains):
            switch(run)
            logits, tails, head_gap = _final(ref_logits, conv, rounded, ref, h_ref, h, prompt_lens)
            faith = _faithfulness(precisions, conv.dtype, emb_gap, head_gap)
            out.append(PassResult({"cosine": emb.cosine, "rel_error": emb.rel}, stats, logits, tails, faith))
    return out


def _switcher(conv, rounded):
    """run numerics -> conv (and the rounded reference, None when it is the bf16 reference, which has no
    MXFP8 to round for) switched to them (runtime.set_numerics)."""
    import runtime

    def switch(numerics) -> None:
        for m in (conv, rounded):
            if m is not None:
                runtime.set_numerics(m, numerics)

    return switch


def _positions(h: torch.Tensor) -> torch.Tensor:
    return torch.arange(h.shape[1], device=h.device)  # [T]


def _faithfulness(precisions: set, dtype, emb_gap: fa.Gap, head_gap: fa.Gap) -> FaithfulnessStats:
    coarsest = max(precisions, key=fa.unit_roundoff)
    u = fa.unit_roundoff(coarsest)
    return FaithfulnessStats(
        str(coarsest).removeprefix("torch."),
        u,
        fa.K,
        emb_gap.error(residual=False),
        emb_gap.limit(fa.unit_roundoff(dtype), residual=False),
        head_gap.error(residual=False),
        head_gap.limit(fa.unit_roundoff(dtype), residual=False),
    )


def _layer(
    r: list, lc, lr, lrr, h_ref: list, h_conv: list, prompt_lens: list, fmt: torch.dtype
) -> LayerStats:
    """One run's stats of one layer, advancing its h_conv in place. r: the bf16 reference layer lr's output
    per sequence (on h_ref); lrr: the rounded reference's layer (lr itself when nothing is quantized)."""
    e2e, local, gap = Acc(), Acc(), fa.Gap()
    for k, p in enumerate(prompt_lens):
        pos = _positions(h_ref[k])
        c = lc(h_conv[k], pos)
        alone = lc(h_ref[k], pos)  # the converted layer on the reference input
        rounded = r[k] if lrr is lr else lrr(h_ref[k], pos)  # the rounded source's layer on the same input
        h = h_ref[k].to(alone.device)
        e2e.add(c[:, :p], r[k][:, :p])
        local.add((alone - h)[:, :p], (r[k] - h_ref[k].to(r[k].device))[:, :p])
        gap.add(alone[:, :p], rounded[:, :p], h[:, :p])
        h_conv[k] = c
    return LayerStats(e2e.cosine, e2e.rel, local.rel, gap.error(), gap.limit(fa.unit_roundoff(fmt)))


class _Projection:
    """Times the first layer of each kind (cfg.layer_kind: attention and MLP type) and logs the projected wall
    time of the whole pass as soon as a kind is first seen; a kind not yet run counts as the slowest seen."""

    def __init__(self, cfg, runs: int = 1):
        self.n, self.runs = cfg.num_hidden_layers, runs
        self.kinds = [cfg.layer_kind(i) for i in range(self.n)]
        self.seconds: dict = {}

    def done(self, i: int, seconds: float) -> None:
        kind = self.kinds[i]
        if kind in self.seconds:
            return
        self.seconds[kind] = seconds
        slowest = max(self.seconds.values())
        total = sum(self.seconds.get(k, slowest) for k in self.kinds)
        log.info(
            "verify: layer %d (%s) ran in %.2f s (reads and compute, every model, %d numerics run(s)); the "
            "teacher-forced pass projects to ~%.1f s for %d layers%s",
            i,
            kind,
            seconds,
            self.runs,
            total,
            self.n,
            ""
            if len(self.seconds) == len(set(self.kinds))
            else " (a kind not yet run counted as the slowest)",
        )


def _final(ref_logits, conv, rounded, ref, h_ref, h_conv, prompt_lens) -> tuple[LogitStats, list, fa.Gap]:
    """One run's final logits against the reference's (ref_logits [T, V] per sequence, on h_ref)."""
    sums, tails, gap = None, [], fa.Gap()
    for lr, a, b, p in zip(ref_logits, h_ref, h_conv, prompt_lens):
        lc = conv.final(b)[0].to(lr.device)
        gap.add(conv.final(a)[0][:p], (lr if rounded is ref else rounded.final(a)[0])[:p])
        s = kl_top(lr[:p], lc[:p])
        sums = (
            s if sums is None else {k: (max(sums[k], s[k]) if k == "max_abs" else sums[k] + s[k]) for k in s}
        )
        tails.append((lr[p - 1 :], lc[p - 1 :]))
    n = sums["n"]
    return LogitStats(sums["kl"] / n, sums["top1"] / n, sums["top5"] / n, sums["max_abs"], n), tails, gap


def kl_per_position(lr: torch.Tensor, lc: torch.Tensor) -> torch.Tensor:
    """lr, lc [T, V] -> KL(ref || conv) per position [T], float64."""
    lpr, lpc = torch.log_softmax(lr.double(), -1), torch.log_softmax(lc.double(), -1)
    return (lpr.exp() * (lpr - lpc)).sum(-1)


def kl_top(lr: torch.Tensor, lc: torch.Tensor) -> dict:
    """lr, lc [T, V] fp32 -> sums over positions."""
    kl = kl_per_position(lr, lc)
    top1 = (lr.argmax(-1) == lc.argmax(-1)).double()
    k = min(5, lr.shape[-1])
    t5r, t5c = lr.topk(k, -1).indices, lc.topk(k, -1).indices
    overlap = (t5r[:, :, None] == t5c[:, None, :]).any(-1).double().sum(-1) / k
    return {
        "kl": float(kl.sum()),
        "top1": float(top1.sum()),
        "top5": float(overlap.sum()),
        "max_abs": float((lr.double() - lc.double()).abs().max()),
        "n": lr.shape[0],
    }
