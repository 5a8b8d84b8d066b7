"""All MiniMax-M3 conversion knowledge: config resolution, tensor names, gate/up order, what to quantize.

Formats: docs/artifact-format.md, docs/serving-engines.md. Two source layouts are understood:
- vendor (`model_type: minimax_m3_vl`, legacy `text_config` keys, `language_model.model.layers.N.…`,
  per-expert `block_sparse_moe.experts.E.w1/w2/w3.weight`, w1 = gate, w3 = up, w2 = down);
- transformers 5.23 native (`model_type: minimax_m3_vl_text`, flat `index_*`, `layer_types`,
  `mlp_layer_types`, `rope_parameters`; fused `mlp.experts.gate_up_proj [E, 2I, H]` gate-first,
  `mlp.experts.down_proj [E, H, I]`, `self_attn.indexer.*`, fused dense/shared `gate_up_proj`).

Both map to one canonical (porter) naming, vendor-style without the `language_model.` prefix:
  model.embed_tokens.weight, model.norm.weight, lm_head.weight
  model.layers.{l}.{input,post_attention}_layernorm.weight
  model.layers.{l}.self_attn.{q,k,v,o}_proj.weight, .{q,k}_norm.weight,
      .index_{q,k}_proj.weight, .index_{q,k}_norm.weight               (sparse layers)
  model.layers.{l}.mlp.{gate,up,down}_proj.weight                      (dense layers)
  model.layers.{l}.block_sparse_moe.gate.weight (fp32), .e_score_correction_bias (fp32)
  model.layers.{l}.block_sparse_moe.shared_experts.{gate,up,down}_proj.weight
  model.layers.{l}.block_sparse_moe.experts.w13_weight [E, 2I, H]  uninterleaved [gate; up]
  model.layers.{l}.block_sparse_moe.experts.w2_weight  [E, H, I]
A quantized `X.weight` / `X.w13_weight` gets a uint8 `X.weight_scale` / `X.w13_weight_scale` beside it.
Tensors outside the text model (vision tower, projectors, MTP) keep their source names, bit-identical.

`--layout hf` (the vendor release's layout, which vLLM and sglang load; `to_hf_layout`): the same tensors
under `language_model.` + canonical name, routed experts per expert as 2-D `experts.{e}.w1/w2/w3.weight`,
scales named `X.weight_scale_inv` (porter.format.layout.scale_name); config.json with the vendor `architectures`
and a top-level mxfp8 `quantization_config` (`hf_config_json`).

This package is the MiniMax-M3 converter (the `converters.base.Converter` protocol): callers reach it
through the registry, `converters.for_config(raw_config)`. Modules: config.py (TextConfig,
resolve_config), names.py (canonical names), plan.py (plan_tensors, expert stacking), hf_layout.py (the
hf_layout capability), verify_rules.py (the verify_rules capability: verify's own source table), sizes.py
(SIZE_RULES: what in the files each config size field must match).
"""

from converters.block_sparse_moe_names import expert_name, experts_w2_name, experts_w13_name
from converters.experts import interleave_gate_up, uninterleave_gate_up
from converters.minimax_m3 import hf_layout, verify_rules
from converters.minimax_m3.config import (
    ARCHITECTURE,
    DENSE_MLP,
    FULL_ATTN,
    MODEL_TYPES,
    MOE_MLP,
    SPARSE_ATTN,
    TextConfig,
    config_sizes,
    manifest_facts,
    resolve_config,
    source_layout,
    text_config_dict,
)
from converters.minimax_m3.hf_layout import DEFAULT_SCOPE, LAYOUTS
from converters.minimax_m3.names import canonical_name, is_stacked_experts
from converters.minimax_m3.plan import plan_tensors
from converters.minimax_m3.sizes import SIZE_RULES

__all__ = [
    "ARCHITECTURE",
    "MODEL_TYPES",
    "LAYOUTS",
    "DEFAULT_SCOPE",
    "hf_layout",
    "verify_rules",
    "SIZE_RULES",
    "SPARSE_ATTN",
    "FULL_ATTN",
    "MOE_MLP",
    "DENSE_MLP",
    "TextConfig",
    "resolve_config",
    "config_sizes",
    "text_config_dict",
    "manifest_facts",
    "source_layout",
    "plan_tensors",
    "canonical_name",
    "experts_w13_name",
    "experts_w2_name",
    "expert_name",
    "is_stacked_experts",
    "interleave_gate_up",
    "uninterleave_gate_up",
]
