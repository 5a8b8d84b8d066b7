"""What in a MiniMax-M2 checkpoint or artifact each size field of its config must match (SIZE_RULES), over
canonical names (converters/minimax_m2/names.py) in every layout porter reads or writes: the release's
per-expert w1/w2/w3 (FP8 or bf16), transformers' fused gate_up_proj/down_proj, porter's stacked w13/w2 and
the hf layout's per-expert tensors. The multi-token-prediction layers after the decoder (`model.layers.{L +
i}`) may be in the files or not. porter/format/sizes.py runs the rules; docs/architecture.md says how.
"""

from __future__ import annotations

from converters.block_sparse_moe_names import EXPERT_SIZE_RULES
from porter.format.sizes import Count, Dim, fields_of

_L = r"model\.layers\.\d+\."
_ATTN = _L + r"self_attn\."

SIZE_RULES = (
    # decoder blocks (an MTP module may hold one too: up to num_mtp_modules more)
    Count(
        "num_hidden_layers",
        r"model\.layers\.(\d+)\.(?:input_layernorm|post_attention_layernorm|self_attn|block_sparse_moe)\..*",
        "decoder layers",
        extra="num_mtp_modules",
    ),
    Dim(("vocab_size",), r"model\.embed_tokens\.weight|lm_head\.weight", 0),
    Dim(("hidden_size",), r"model\.embed_tokens\.weight|lm_head\.weight", 1),
    Dim(("hidden_size",), r"model\.norm\.weight|" + _L + r"(input|post_attention)_layernorm\.weight", 0),
    Dim(("num_attention_heads", "head_dim"), _ATTN + r"(q_proj|q_norm)\.weight", 0),  # q_norm: all heads
    Dim(("num_attention_heads", "head_dim"), _ATTN + r"o_proj\.weight", 1),
    Dim(("num_key_value_heads", "head_dim"), _ATTN + r"(k_proj|v_proj|k_norm)\.weight", 0),
    *EXPERT_SIZE_RULES,
)
SIZE_FIELDS = fields_of(SIZE_RULES)
