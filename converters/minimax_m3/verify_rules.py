"""`porter verify`'s own MiniMax-M3 source table: where each artifact tensor comes from, per source layout.

Written independently of this converter's plan (plan.py, names.py: nothing of this package is imported),
so that a layout bug there (gate/up reversed, experts permuted, w2 transposed) is not on both sides of
verify's comparison. Rule templates and ops: porter/commands/verify/mapping.py. {m} the model root
(`language_model.model.`, `model.language_model.` or `model.`), {h} the lm_head root.
"""

from __future__ import annotations

import re
from typing import Optional

from converters.base import Rule

HF_PREFIX = "language_model."  # the hf layout's text-model names: this prefix + the canonical name
MODEL_ROOTS = ("language_model.model.", "model.language_model.", "model.")
HEAD_ROOTS = ("language_model.lm_head.", "lm_head.")

_L = r"model\.layers\.(?P<L>\d+)\."
_W13 = _L + r"block_sparse_moe\.experts\.w13_weight"
_W2 = _L + r"block_sparse_moe\.experts\.w2_weight"
_TOP = (Rule(r"lm_head\.(?P<rest>.+)", ("{h}{rest}",)), Rule(r"model\.(?P<rest>.+)", ("{m}{rest}",)))
_PER_EXPERT = re.compile(
    r"model\.layers\.(?P<L>\d+)\.block_sparse_moe\.experts\.(?P<E>\d+)\.w(?P<w>[123])\.weight"
)
_STACKED = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.(w13|w2)_weight")

# MiniMaxAI release: `language_model.` prefix, per-expert w1 (gate), w3 (up), w2 (down).
VENDOR = (
    Rule(
        _W13,
        (
            "{m}layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
            "{m}layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
        ),
        "experts_rows",
    ),
    Rule(_W2, ("{m}layers.{L}.block_sparse_moe.experts.{E}.w2.weight",), "experts_rows"),
) + _TOP


def transformers_rules(interleaved: bool) -> tuple:
    """transformers 5.23: fused experts gate_up_proj [E, 2I, H] (gate first) / down_proj [E, H, I], `mlp.`
    names, fused dense/shared gate_up_proj.weight [2N, H], `self_attn.indexer.*`."""
    return (
        Rule(
            _W13,
            ("{m}layers.{L}.mlp.experts.gate_up_proj",),
            "expert_slice_interleaved" if interleaved else "expert_slice",
        ),
        Rule(_W2, ("{m}layers.{L}.mlp.experts.down_proj",), "expert_slice"),
        # one expert's 2-D weight (an artifact in the hf layout): rows of the fused tensor's expert E
        Rule(
            _L + r"block_sparse_moe\.experts\.(?P<E>\d+)\.w(?P<w>[13])\.weight",
            ("{m}layers.{L}.mlp.experts.gate_up_proj",),
            "index_w{w}" + ("_interleaved" if interleaved else ""),
        ),
        Rule(
            _L + r"block_sparse_moe\.experts\.(?P<E>\d+)\.w2\.weight",
            ("{m}layers.{L}.mlp.experts.down_proj",),
            "index",
        ),
        Rule(_L + r"block_sparse_moe\.gate\.weight", ("{m}layers.{L}.mlp.gate.weight",)),
        Rule(
            _L + r"block_sparse_moe\.e_score_correction_bias",
            ("{m}layers.{L}.mlp.gate.e_score_correction_bias",),
        ),
        Rule(
            _L + r"block_sparse_moe\.shared_experts\.(?P<part>gate|up)_proj\.weight",
            ("{m}layers.{L}.mlp.shared_experts.gate_up_proj.weight",),
            "{part}_half",
        ),
        Rule(
            _L + r"block_sparse_moe\.shared_experts\.(?P<rest>.+)",
            ("{m}layers.{L}.mlp.shared_experts.{rest}",),
        ),
        Rule(
            _L + r"mlp\.(?P<part>gate|up)_proj\.weight",
            ("{m}layers.{L}.mlp.gate_up_proj.weight",),
            "{part}_half",
        ),
        Rule(
            _L + r"self_attn\.index_(?P<x>[qk])_(?P<y>proj|norm)\.weight",
            ("{m}layers.{L}.self_attn.indexer.{x}_{y}.weight",),
        ),
    ) + _TOP


def source_rules(names: set, interleaved: bool) -> tuple:
    if any(re.search(r"\.experts\.\d+\.w1\.weight$", n) for n in names):
        return "vendor", VENDOR
    if any(n.endswith("mlp.experts.gate_up_proj") for n in names):
        return "transformers" + (" (interleaved gate/up)" if interleaved else ""), transformers_rules(
            interleaved
        )
    return "vendor", VENDOR  # no routed experts: both tables read the same


def roots(names: set) -> dict:
    return {"m": _root(names, MODEL_ROOTS, "embed_tokens.weight"), "h": _root(names, HEAD_ROOTS, "weight")}


def _root(names: set, candidates: tuple, probe: str) -> str:
    return next((r for r in candidates if r + probe in names), candidates[-1])


def canonical(name: str, layout: str) -> str:
    if layout == "hf" and name.startswith(HF_PREFIX):
        return name[len(HF_PREFIX) :]
    return name


def experts_of(canonical: str) -> Optional[tuple]:
    if _STACKED.fullmatch(canonical):
        return canonical, None
    m = _PER_EXPERT.fullmatch(canonical)
    if m is None:
        return None
    part = "w2" if m["w"] == "2" else "w13"
    return f"model.layers.{m['L']}.block_sparse_moe.experts.{part}_weight", int(m["E"])
