"""MiniMax-M2 canonical tensor names: source spellings (vendor, transformers' in-memory names) -> porter's,
and the names of the stacked and per-expert routed expert weights. The naming table:
converters/minimax_m2/__init__.py.
"""

from __future__ import annotations

import re
from typing import Optional

from converters.experts import ExpertNames

# one routed expert's 2-D weight (vendor layout, hf layout): layer, expert, w1 | w2 | w3
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_TOP = ("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")


def canonical_name(src: str) -> Optional[str]:
    """Source tensor name -> canonical name (vendor spelling), None for names outside the model."""
    if not src.startswith(_TOP):
        return None
    # transformers' in-memory names (MiniMaxM2SparseMoeBlock: mlp.gate, mlp.e_score_correction_bias,
    # fused mlp.experts.gate_up_proj / down_proj) -> the release's block_sparse_moe names
    return src.replace(".mlp.", ".block_sparse_moe.")


def experts_w13_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w13_weight"


def experts_w2_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w2_weight"


def expert_name(layer: int, e: int, w: str) -> str:
    """Canonical name of one expert's 2-D weight: w1 gate, w3 up, w2 down."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"


EXPERTS = ExpertNames(experts_w13_name, experts_w2_name, expert_name, PER_EXPERT)
