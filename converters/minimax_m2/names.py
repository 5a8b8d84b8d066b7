"""MiniMax-M2 canonical tensor names: source spellings (vendor, transformers' in-memory names) -> porter's
(the routed experts' names: converters/block_sparse_moe_names.py). The naming table:
converters/minimax_m2/__init__.py.
"""

from __future__ import annotations

from typing import Optional

_TOP = ("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")


def canonical_name(src: str) -> Optional[str]:
    """Source tensor name -> canonical name (vendor spelling), None for names outside the model."""
    if not src.startswith(_TOP):
        return None
    # transformers' in-memory names (MiniMaxM2SparseMoeBlock: mlp.gate, mlp.e_score_correction_bias,
    # fused mlp.experts.gate_up_proj / down_proj) -> the release's block_sparse_moe names
    return src.replace(".mlp.", ".block_sparse_moe.")
