"""What in a MiniMax-M3 checkpoint or artifact each size field of its config must match (SIZE_RULES), over
canonical names (converters/minimax_m3/names.py) in every layout porter reads or writes: the vendor's
per-expert w1/w2/w3, transformers' fused gate_up_proj/down_proj, porter's stacked w13/w2, and the hf
layout's per-expert tensors. porter/format/sizes.py runs them; docs/architecture.md says how.
"""

from __future__ import annotations

from converters.block_sparse_moe_names import EXPERT_SIZE_RULES
from porter.format.sizes import Count, Dim, fields_of

_L = r"model\.layers\.\d+\."
_ATTN = _L + r"self_attn\."
_SHARED = _L + r"block_sparse_moe\.shared_experts\."

SIZE_RULES = (
    Count("num_hidden_layers", r"model\.layers\.(\d+)\..*", "layers"),
    Dim(("vocab_size",), r"model\.embed_tokens\.weight|lm_head\.weight", 0),
    Dim(("hidden_size",), r"model\.embed_tokens\.weight|lm_head\.weight", 1),
    Dim(("hidden_size",), r"model\.norm\.weight|" + _L + r"(input|post_attention)_layernorm\.weight", 0),
    Dim(("head_dim",), _ATTN + r"[qk]_norm\.weight", 0),
    Dim(("num_attention_heads", "head_dim"), _ATTN + r"q_proj\.weight", 0),
    Dim(("num_attention_heads", "head_dim"), _ATTN + r"o_proj\.weight", 1),
    Dim(("num_key_value_heads", "head_dim"), _ATTN + r"[kv]_proj\.weight", 0),
    Dim(("index_head_dim",), _ATTN + r"index_k_proj\.weight|" + _ATTN + r"index_[qk]_norm\.weight", 0),
    Dim(("index_n_heads", "index_head_dim"), _ATTN + r"index_q_proj\.weight", 0),
    Dim(("dense_intermediate_size",), _L + r"mlp\.(gate|up)_proj\.weight", 0),
    Dim(("dense_intermediate_size",), _L + r"mlp\.down_proj\.weight", 1),
    Dim(("dense_intermediate_size",), _L + r"mlp\.gate_up_proj\.weight", 0, factor=2),
    Dim(("shared_intermediate_size",), _SHARED + r"(gate|up)_proj\.weight", 0),
    Dim(("shared_intermediate_size",), _SHARED + r"down_proj\.weight", 1),
    Dim(("shared_intermediate_size",), _SHARED + r"gate_up_proj\.weight", 0, factor=2),
    *EXPERT_SIZE_RULES,
)
SIZE_FIELDS = fields_of(SIZE_RULES)
