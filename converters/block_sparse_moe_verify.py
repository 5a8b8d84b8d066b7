"""`porter verify`'s own rules for the `block_sparse_moe` expert layout (Mixtral's naming, used by more than
one family): per-expert w1 (gate), w3 (up), w2 (down) at `model.layers.{L}.block_sparse_moe.experts.{E}.`,
stacked by porter into `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I]; and transformers' fused
`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] for the same experts.

Written independently of every converter's names and plan (only converters.base is imported), so that a
layout bug there is not on both sides of verify's comparison. Rule templates and ops:
porter/commands/verify/mapping.py; {m} is the family's model root.
"""

from __future__ import annotations

import re
from typing import Optional

from converters.base import Rule

L = r"model\.layers\.(?P<L>\d+)\."
_W13 = L + r"block_sparse_moe\.experts\.w13_weight"
_W2 = L + r"block_sparse_moe\.experts\.w2_weight"
_PER_EXPERT = re.compile(
    r"model\.layers\.(?P<L>\d+)\.block_sparse_moe\.experts\.(?P<E>\d+)\.w(?P<w>[123])\.weight"
)
_STACKED = re.compile(r"model\.layers\.\d+\.block_sparse_moe\.experts\.(w13|w2)_weight")

# per-expert sources: w13 = [w1; w3] of each expert, w2 = its w2
PER_EXPERT_RULES = (
    Rule(
        _W13,
        (
            "{m}layers.{L}.block_sparse_moe.experts.{E}.w1.weight",
            "{m}layers.{L}.block_sparse_moe.experts.{E}.w3.weight",
        ),
        "experts_rows",
    ),
    Rule(_W2, ("{m}layers.{L}.block_sparse_moe.experts.{E}.w2.weight",), "experts_rows"),
)


def fused_expert_rules(interleaved: bool) -> tuple:
    """transformers' fused experts (gate first, or gate/up rows alternating when `interleaved`) and its
    router `mlp.gate.weight`, for stacked artifact experts and for one expert's 2-D weight (hf layout)."""
    inter = "_interleaved" if interleaved else ""
    return (
        Rule(_W13, ("{m}layers.{L}.mlp.experts.gate_up_proj",), "expert_slice" + inter),
        Rule(_W2, ("{m}layers.{L}.mlp.experts.down_proj",), "expert_slice"),
        # one expert's 2-D weight (an artifact in the hf layout): rows of the fused tensor's expert E
        Rule(
            L + r"block_sparse_moe\.experts\.(?P<E>\d+)\.w(?P<w>[13])\.weight",
            ("{m}layers.{L}.mlp.experts.gate_up_proj",),
            "index_w{w}" + inter,
        ),
        Rule(
            L + r"block_sparse_moe\.experts\.(?P<E>\d+)\.w2\.weight",
            ("{m}layers.{L}.mlp.experts.down_proj",),
            "index",
        ),
        Rule(L + r"block_sparse_moe\.gate\.weight", ("{m}layers.{L}.mlp.gate.weight",)),
    )


def experts_of(canonical: str) -> Optional[tuple]:
    """(stacked expert tensor, expert index or None) of a canonical expert name; None for other names."""
    if _STACKED.fullmatch(canonical):
        return canonical, None
    m = _PER_EXPERT.fullmatch(canonical)
    if m is None:
        return None
    part = "w2" if m["w"] == "2" else "w13"
    return f"model.layers.{m['L']}.block_sparse_moe.experts.{part}_weight", int(m["E"])
