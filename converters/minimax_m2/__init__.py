"""All MiniMax-M2 conversion knowledge (M2, M2.1, M2.5: `model_type: minimax_m2`): config resolution, tensor
names, what to quantize. Facts: docs/minimax-m2.md.

Source layouts:
- vendor: the release (FP8 e4m3 with 128x128 block scales `X.weight_scale_inv`, quantization_config
  `quant_method: fp8`, `weight_block_size`; read through porter.format.prequantized, each weight
  dequantized when read) or a bf16 checkpoint under the same names, which is also what transformers 5.23's
  save_pretrained writes: `model.layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight` (w1 gate, w3 up,
  w2 down), `block_sparse_moe.gate.weight`, `block_sparse_moe.e_score_correction_bias`;
- transformers' in-memory names: `mlp.experts.gate_up_proj [E, 2I, H]` ([gate; up]),
  `mlp.experts.down_proj [E, H, I]`, `mlp.gate.weight`, `mlp.e_score_correction_bias`.

Canonical (porter) naming, the vendor spelling:
  model.embed_tokens.weight, model.norm.weight, lm_head.weight
  model.layers.{l}.{input,post_attention}_layernorm.weight
  model.layers.{l}.self_attn.{q,k,v,o}_proj.weight, .{q,k}_norm.weight ([nq*d] / [nkv*d]: all heads)
  model.layers.{l}.block_sparse_moe.gate.weight, .e_score_correction_bias
  model.layers.{l}.block_sparse_moe.experts.w13_weight [E, 2I, H]  [gate; up]
  model.layers.{l}.block_sparse_moe.experts.w2_weight  [E, H, I]
Multi-token-prediction layers (model.layers.{L + i}) are carried under their source names.

`--layout hf`: the same names with one 2-D tensor per expert and `X.weight_scale_inv` scales; config.json
with porter's mxfp8 quantization_config in place of the source's.

This package is the MiniMax-M2 converter (the `converters.base.Converter` protocol), reached through the
registry. Modules: config.py, names.py, plan.py, hf_layout.py (the hf_layout capability), verify_rules.py
(the verify_rules capability: verify's own source table), sizes.py (SIZE_RULES: what in the files each
config size field must match).
"""

from converters.block_sparse_moe_names import expert_name, experts_w2_name, experts_w13_name
from converters.minimax_m2 import hf_layout, verify_rules
from converters.minimax_m2.config import (
    ARCHITECTURE,
    MODEL_TYPES,
    TextConfig,
    config_sizes,
    manifest_facts,
    resolve_config,
    source_layout,
)
from converters.minimax_m2.hf_layout import DEFAULT_SCOPE
from converters.minimax_m2.names import canonical_name
from converters.minimax_m2.plan import LAYOUTS, plan_tensors
from converters.minimax_m2.sizes import SIZE_RULES

__all__ = [
    "ARCHITECTURE",
    "MODEL_TYPES",
    "LAYOUTS",
    "DEFAULT_SCOPE",
    "hf_layout",
    "verify_rules",
    "SIZE_RULES",
    "TextConfig",
    "resolve_config",
    "config_sizes",
    "manifest_facts",
    "source_layout",
    "plan_tensors",
    "canonical_name",
    "experts_w13_name",
    "experts_w2_name",
    "expert_name",
]
