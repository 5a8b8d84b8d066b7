"""MiniMax-M3 canonical tensor names: source spellings (vendor, transformers) -> porter's (the routed
experts' names: converters/block_sparse_moe_names.py). The naming table: converters/minimax_m3/__init__.py.
"""

from __future__ import annotations

import re
from typing import Optional

from converters.block_sparse_moe_names import STACKED_EXPERTS


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


def is_stacked_experts(name: str) -> bool:
    """A canonical stacked expert tensor ([E, 2I, H] w13 or [E, H, I] w2)."""
    return bool(STACKED_EXPERTS.match(name))
