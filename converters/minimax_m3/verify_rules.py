"""`porter verify`'s own MiniMax-M3 source table: where each artifact tensor comes from, per source layout.

Written independently of this converter's plan (plan.py, names.py: nothing of this package is imported),
so that a layout bug there (gate/up reversed, experts permuted, w2 transposed) is not on both sides of
verify's comparison. Rule templates and ops: porter/commands/verify/mapping.py. {m} the model root
(`language_model.model.`, `model.language_model.` or `model.`), {h} the lm_head root.
"""

from __future__ import annotations

import re

from converters import block_sparse_moe_verify as per_expert
from converters.base import Rule
from converters.block_sparse_moe_verify import PER_EXPERT_RULES, L, fused_expert_rules

HF_PREFIX = "language_model."  # the hf layout's text-model names: this prefix + the canonical name
MODEL_ROOTS = ("language_model.model.", "model.language_model.", "model.")
HEAD_ROOTS = ("language_model.lm_head.", "lm_head.")

_TOP = (Rule(r"lm_head\.(?P<rest>.+)", ("{h}{rest}",)), Rule(r"model\.(?P<rest>.+)", ("{m}{rest}",)))

# MiniMaxAI release: `language_model.` prefix, per-expert w1 (gate), w3 (up), w2 (down).
VENDOR = PER_EXPERT_RULES + _TOP


def transformers_rules(interleaved: bool) -> tuple:
    """transformers 5.23: fused experts gate_up_proj [E, 2I, H] (gate first) / down_proj [E, H, I], `mlp.`
    names, fused dense/shared gate_up_proj.weight [2N, H], `self_attn.indexer.*`."""
    return (
        fused_expert_rules(interleaved)
        + (
            Rule(
                L + r"block_sparse_moe\.e_score_correction_bias",
                ("{m}layers.{L}.mlp.gate.e_score_correction_bias",),
            ),
            Rule(
                L + r"block_sparse_moe\.shared_experts\.(?P<part>gate|up)_proj\.weight",
                ("{m}layers.{L}.mlp.shared_experts.gate_up_proj.weight",),
                "{part}_half",
            ),
            Rule(
                L + r"block_sparse_moe\.shared_experts\.(?P<rest>.+)",
                ("{m}layers.{L}.mlp.shared_experts.{rest}",),
            ),
            Rule(
                L + r"mlp\.(?P<part>gate|up)_proj\.weight",
                ("{m}layers.{L}.mlp.gate_up_proj.weight",),
                "{part}_half",
            ),
            Rule(
                L + r"self_attn\.index_(?P<x>[qk])_(?P<y>proj|norm)\.weight",
                ("{m}layers.{L}.self_attn.indexer.{x}_{y}.weight",),
            ),
        )
        + _TOP
    )


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


experts_of = per_expert.experts_of  # the block_sparse_moe experts' grouping
