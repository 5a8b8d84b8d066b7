"""`porter verify`'s own MiniMax-M2 source table: where each artifact tensor comes from, per source layout.

Written independently of this converter's plan (nothing of converters/minimax_m2 is imported), so a layout
bug there (gate/up reversed, experts permuted, w2 transposed) is not on both sides of verify's comparison.
Rule templates and ops: porter/commands/verify/mapping.py. {m} is the model root, `model.`.
"""

from __future__ import annotations

from converters import block_sparse_moe_verify as per_expert
from converters.base import Rule
from converters.block_sparse_moe_verify import PER_EXPERT_RULES, L, fused_expert_rules

_TOP = (Rule(r"lm_head\.(?P<rest>.+)", ("lm_head.{rest}",)), Rule(r"model\.(?P<rest>.+)", ("{m}{rest}",)))

# The release (and transformers' save_pretrained): per-expert w1 (gate), w3 (up), w2 (down).
VENDOR = PER_EXPERT_RULES + _TOP


def transformers_rules(interleaved: bool) -> tuple:
    """transformers 5.23's in-memory names: mlp.experts.gate_up_proj [E, 2I, H] (gate first; chunk(2) of
    the output), mlp.experts.down_proj [E, H, I], mlp.gate.weight, mlp.e_score_correction_bias."""
    return (
        fused_expert_rules(interleaved)
        + (
            Rule(
                L + r"block_sparse_moe\.e_score_correction_bias",
                ("{m}layers.{L}.mlp.e_score_correction_bias",),
            ),
        )
        + _TOP
    )


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


experts_of = per_expert.experts_of  # the block_sparse_moe experts' grouping
