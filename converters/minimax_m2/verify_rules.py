"""`porter verify`'s own MiniMax-M2 source table: where each artifact tensor comes from, per source layout.

Written independently of this converter's plan (nothing of converters/minimax_m2 is imported), so a layout
bug there (gate/up reversed, experts permuted, w2 transposed) is not on both sides of verify's comparison.
Rule templates and ops: porter/commands/verify/mapping.py. {m} is the model root, `model.`.
"""

from __future__ import annotations

import re
from typing import Optional

from converters.base import Rule

_L = r"model\.layers\.(?P<L>\d+)\."
_W13 = _L + r"block_sparse_moe\.experts\.w13_weight"
_W2 = _L + r"block_sparse_moe\.experts\.w2_weight"
_TOP = (Rule(r"lm_head\.(?P<rest>.+)", ("lm_head.{rest}",)), Rule(r"model\.(?P<rest>.+)", ("{m}{rest}",)))
_PER_EXPERT = re.compile(
    r"model\.layers\.(?P<L>\d+)\.block_sparse_moe\.experts\.(?P<E>\d+)\.w(?P<w>[123])\.weight"
)
_STACKED = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.(w13|w2)_weight")

# The release (and transformers' save_pretrained): per-expert w1 (gate), w3 (up), w2 (down).
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
    """transformers 5.23's in-memory names: mlp.experts.gate_up_proj [E, 2I, H] (gate first; chunk(2) of
    the output), mlp.experts.down_proj [E, H, I], mlp.gate.weight, mlp.e_score_correction_bias."""
    inter = "_interleaved" if interleaved else ""
    return (
        Rule(_W13, ("{m}layers.{L}.mlp.experts.gate_up_proj",), "expert_slice" + inter),
        Rule(_W2, ("{m}layers.{L}.mlp.experts.down_proj",), "expert_slice"),
        Rule(
            _L + r"block_sparse_moe\.experts\.(?P<E>\d+)\.w(?P<w>[13])\.weight",
            ("{m}layers.{L}.mlp.experts.gate_up_proj",),
            "index_w{w}" + inter,
        ),
        Rule(
            _L + r"block_sparse_moe\.experts\.(?P<E>\d+)\.w2\.weight",
            ("{m}layers.{L}.mlp.experts.down_proj",),
            "index",
        ),
        Rule(_L + r"block_sparse_moe\.gate\.weight", ("{m}layers.{L}.mlp.gate.weight",)),
        Rule(
            _L + r"block_sparse_moe\.e_score_correction_bias",
            ("{m}layers.{L}.mlp.e_score_correction_bias",),
        ),
    ) + _TOP


def source_rules(names: set, interleaved: bool) -> tuple:
    if any(n.endswith(".mlp.experts.gate_up_proj") for n in names):
        return "transformers" + (" (interleaved gate/up)" if interleaved else ""), transformers_rules(
            interleaved
        )
    return "vendor", VENDOR


def roots(names: set) -> dict:
    return {"m": "model."}


def canonical(name: str, layout: str) -> str:
    return name  # the hf layout keeps the release's names, which are the canonical ones


def experts_of(canonical: str) -> Optional[tuple]:
    if _STACKED.fullmatch(canonical):
        return canonical, None
    m = _PER_EXPERT.fullmatch(canonical)
    if m is None:
        return None
    part = "w2" if m["w"] == "2" else "w13"
    return f"model.layers.{m['L']}.block_sparse_moe.experts.{part}_weight", int(m["E"])
