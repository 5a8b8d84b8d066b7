"""Canonical names of routed experts in the `block_sparse_moe` layout (Mixtral's naming, used by more than
one family): one expert's 2-D weights `model.layers.{l}.block_sparse_moe.experts.{e}.w1/w2/w3.weight`
(w1 gate, w3 up, w2 down) and porter's stacked `w13_weight` [E, 2I, H] / `w2_weight` [E, H, I]. A family
whose experts use it takes `EXPERTS` (converters/experts.py's ExpertNames) from here.
"""

from __future__ import annotations

import re

from converters.experts import ExpertNames

# one routed expert's 2-D weight (vendor layout, hf layout): layer, expert, w1 | w2 | w3
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
STACKED_EXPERTS = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.experts\.(w13|w2)_weight$")


def experts_w13_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w13_weight"


def experts_w2_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w2_weight"


def expert_name(layer: int, e: int, w: str) -> str:
    """Canonical name of one expert's 2-D weight: w1 gate, w3 up, w2 down."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"


EXPERTS = ExpertNames(experts_w13_name, experts_w2_name, expert_name, PER_EXPERT)
