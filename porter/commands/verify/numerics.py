"""Step 3 of `porter verify`: the reference and the converted model through the same runtime, layer by layer.

Both models see the same token sequences (each prompt, extended by the converted model's greedy
continuation when there is one: generation.py). Per decoder layer, over the prompt positions:
- `cosine`, `rel_error`: the residual stream after the layer, each model fed its own previous output
  (end to end: errors accumulate over depth);
- `layer_error`: the layer alone, both fed the *reference* input: ||d_conv - d_ref|| / ||d_ref|| for the
  layer's update d = layer(h) - h. Upstream error cannot leak into it, so it names the wrong layer.
Final logits over the prompt positions: KL(ref || conv) (mean per position, nats), top-1 agreement,
top-5 overlap, max |logit difference|. The logits at the continuation positions are handed back for
the teacher-forced scoring of the continuation: one pass of the reference over prompt + continuation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from porter.commands.verify.verdict import LogitStats


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


@dataclass
class PassResult:
    embeddings: dict
    layers: list  # [LayerStats] per decoder layer
    logits: LogitStats
    tails: list  # per sequence: (reference logits, converted logits) [n, V] at positions P-1 .. T-1


def compare_models(ref, conv, seqs: list, prompt_lens: list, progress: bool = False) -> PassResult:
    """seqs: LongTensor [1, T] per sequence; prompt_lens: P per sequence (stats over positions < P)."""
    with torch.inference_mode():
        h_ref, h_conv = [ref.embed(x) for x in seqs], [conv.embed(x) for x in seqs]
        emb = Acc()
        for a, b, p in zip(h_conv, h_ref, prompt_lens):
            emb.add(a[:, :p], b[:, :p])
        layers = []
        for i in tqdm(range(ref.cfg.num_hidden_layers), desc="verify layers", disable=not progress):
            layers.append(_layer(ref.layers[i], conv.layers[i], h_ref, h_conv, prompt_lens))
        for m in (ref, conv):
            if hasattr(m.layers, "release"):
                m.layers.release()
        logits, tails = _final(ref, conv, h_ref, h_conv, prompt_lens)
    return PassResult({"cosine": emb.cosine, "rel_error": emb.rel}, layers, logits, tails)


def _layer(lr, lc, h_ref: list, h_conv: list, prompt_lens: list) -> LayerStats:
    """Runs one layer of each model on every sequence, advancing h_ref / h_conv in place."""
    e2e, local = Acc(), Acc()
    for k, p in enumerate(prompt_lens):
        pos = torch.arange(h_ref[k].shape[1], device=h_ref[k].device)
        r, c = lr(h_ref[k], pos), lc(h_conv[k], pos)
        alone = lc(h_ref[k], pos)  # the converted layer on the reference input
        e2e.add(c[:, :p], r[:, :p])
        local.add((alone - h_ref[k].to(alone.device))[:, :p], (r - h_ref[k].to(r.device))[:, :p])
        h_ref[k], h_conv[k] = r, c
    return LayerStats(e2e.cosine, e2e.rel, local.rel)


def _final(ref, conv, h_ref, h_conv, prompt_lens) -> tuple[LogitStats, list]:
    sums, tails = None, []
    for a, b, p in zip(h_ref, h_conv, prompt_lens):
        lr = ref.final(a)[0]
        lc = conv.final(b)[0].to(lr.device)
        s = kl_top(lr[:p], lc[:p])
        sums = (
            s if sums is None else {k: (max(sums[k], s[k]) if k == "max_abs" else sums[k] + s[k]) for k in s}
        )
        tails.append((lr[p - 1 :], lc[p - 1 :]))
    n = sums["n"]
    return LogitStats(sums["kl"] / n, sums["top1"] / n, sums["top5"] / n, sums["max_abs"], n), tails


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
