"""MiniMax-M3 canonical tensor names: source spellings (vendor, transformers) -> porter's, and the names
of the stacked and per-expert routed expert weights. The naming table: converters/minimax_m3/__init__.py.
"""

from __future__ import annotations

import re
from typing import Optional

from converters.experts import ExpertNames

# one routed expert's 2-D weight (vendor layout, hf layout): layer, expert, w1 | w2 | w3
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_STACKED_EXPERTS = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.experts\.(w13|w2)_weight$")


def canonical_name(src: str) -> Optional[str]:
    """Source tensor name -> canonical text-model name, or None for tensors outside the text model."""
    for old, new in (
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    ):
        if src.startswith(old):
            src = new + src[len(old) :]
            break
    else:
        if not (
            src.startswith("model.layers.")
            or src.startswith("model.embed_tokens.")
            or src.startswith("model.norm.")
            or src.startswith("lm_head.")
        ):
            return None
    if src.startswith("model.mtp."):
        return None  # MTP heads are carried under their source name, not run
    # transformers-native spellings -> vendor spellings
    src = re.sub(r"\.self_attn\.indexer\.([qk])_(proj|norm)\.", r".self_attn.index_\1_\2.", src)
    src = src.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
    src = src.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    src = src.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")
    src = src.replace(".mlp.experts.", ".block_sparse_moe.experts.")
    return src


def experts_w13_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w13_weight"


def experts_w2_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w2_weight"


def expert_name(layer: int, e: int, w: str) -> str:
    """Canonical name of one expert's 2-D weight: w1 gate, w3 up, w2 down."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"


def is_stacked_experts(name: str) -> bool:
    """A canonical stacked expert tensor ([E, 2I, H] w13 or [E, H, I] w2)."""
    return bool(_STACKED_EXPERTS.match(name))


EXPERTS = ExpertNames(experts_w13_name, experts_w2_name, expert_name, PER_EXPERT)
