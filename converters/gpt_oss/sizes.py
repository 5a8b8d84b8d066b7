"""What in a gpt-oss checkpoint or artifact each size field of its config must match (SIZE_RULES), over
canonical names (converters/gpt_oss/names.py, the sources' own) in every layout porter reads or writes:
OpenAI's MXFP4 release (`mlp.experts.*_blocks` [E, out, in/32, 16] as stored, [E, out, in] as read: only
their first two dimensions are used), transformers' bf16 experts ([E, in, out]) and porter's stacked
w13/w2 with their biases. porter/format/sizes.py runs the rules; docs/architecture.md says how.
"""

from __future__ import annotations

from porter.format.sizes import Count, Dim, fields_of

_L = r"model\.layers\.\d+\."
_ATTN = _L + r"self_attn\."
_EXPERTS = _L + r"mlp\.experts\."

SIZE_RULES = (
    Count("num_hidden_layers", r"model\.layers\.(\d+)\..*", "layers"),
    Dim(("vocab_size",), r"model\.embed_tokens\.weight|lm_head\.weight", 0),
    Dim(("hidden_size",), r"model\.embed_tokens\.weight|lm_head\.weight", 1),
    Dim(("hidden_size",), r"model\.norm\.weight|" + _L + r"(input|post_attention)_layernorm\.weight", 0),
    Dim(("num_attention_heads",), _ATTN + r"sinks", 0),
    Dim(("num_attention_heads", "head_dim"), _ATTN + r"q_proj\.(weight|bias)", 0),
    Dim(("num_attention_heads", "head_dim"), _ATTN + r"o_proj\.weight", 1),
    Dim(("num_key_value_heads", "head_dim"), _ATTN + r"[kv]_proj\.(weight|bias)", 0),
    Dim(("num_local_experts",), _L + r"mlp\.router\.(weight|bias)", 0),
    Dim(("num_local_experts",), _EXPERTS + r"\w+", 0),  # every routed-expert tensor is [E, ...]
    Dim(
        ("intermediate_size",),
        _EXPERTS + r"(w13_weight|w13_bias|gate_up_proj_blocks|gate_up_proj_bias)",
        1,
        2,
    ),
    Dim(("intermediate_size",), _EXPERTS + r"gate_up_proj", 2, factor=2),  # transformers' [E, H, 2I]
    Dim(("intermediate_size",), _EXPERTS + r"(w2_weight)", 2),
    Dim(("intermediate_size",), _EXPERTS + r"down_proj", 1),  # transformers' [E, I, H]
    Dim(("hidden_size",), _EXPERTS + r"(w2_weight|w2_bias|down_proj_blocks|down_proj_bias)", 1),
)
SIZE_FIELDS = fields_of(SIZE_RULES)
