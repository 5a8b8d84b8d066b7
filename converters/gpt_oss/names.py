"""gpt-oss tensor names: the sources' (the OpenAI release's MXFP4 experts, transformers' bf16 experts) and
porter's canonical ones.

Canonical (porter layout) names are transformers' for everything but the routed experts:
  model.embed_tokens.weight, model.norm.weight, lm_head.weight
  model.layers.{l}.{input,post_attention}_layernorm.weight
  model.layers.{l}.self_attn.{q,k,v,o}_proj.{weight,bias}, model.layers.{l}.self_attn.sinks [nq]
  model.layers.{l}.mlp.router.{weight [E, H], bias [E]}
  model.layers.{l}.mlp.experts.w13_weight [E, 2I, H]  uninterleaved [gate; up] rows (+ w13_weight_scale)
  model.layers.{l}.mlp.experts.w2_weight  [E, H, I]   (+ w2_weight_scale)
  model.layers.{l}.mlp.experts.w13_bias   [E, 2I]     uninterleaved [gate; up]
  model.layers.{l}.mlp.experts.w2_bias    [E, H]
Source experts: `mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] (+ `_scales`) and `down_proj_blocks`
[E, H, I/32, 16] in the MXFP4 release (`[out, in]`, read as bf16 [E, 2I, H] / [E, H, I] through
porter.format.prequantized), or bf16 `mlp.experts.gate_up_proj` [E, H, 2I] / `down_proj` [E, I, H]
(`[in, out]`) in transformers' layout; `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H] in both.
Gate and up alternate along 2I everywhere in the sources (gate = gu[..., ::2], up = gu[..., 1::2]).
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from converters.experts import uninterleave_gate_up
from porter.format.prequantized import DEQUANTIZED_DTYPE

EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\w+)$")
MXFP4_GATE_UP, MXFP4_DOWN = "gate_up_proj_blocks", "down_proj_blocks"  # dequantized [E, out, in]
BF16_GATE_UP, BF16_DOWN = "gate_up_proj", "down_proj"  # [E, in, out]
GATE_UP_BIAS, DOWN_BIAS = "gate_up_proj_bias", "down_proj_bias"
DEQUANTIZED = DEQUANTIZED_DTYPE  # the dtype porter.format.prequantized lists an MXFP4 weight as


def canonical_name(src: str) -> Optional[str]:
    """Source (or artifact) tensor name -> canonical name; None outside the text model (none in the release)."""
    if src.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")):
        return src
    return None


def experts_prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp.experts."


def experts_w13_name(layer: int) -> str:
    return experts_prefix(layer) + "w13_weight"


def experts_w2_name(layer: int) -> str:
    return experts_prefix(layer) + "w2_weight"


def experts_w13_bias_name(layer: int) -> str:
    return experts_prefix(layer) + "w13_bias"


def experts_w2_bias_name(layer: int) -> str:
    return experts_prefix(layer) + "w2_bias"


def uninterleave_bias(b: torch.Tensor) -> torch.Tensor:
    """A gate_up bias [..., 2I], entries gate0, up0, ... -> [gate; up]: the rows rule (converters.experts)
    applied to its entries as rows."""
    return uninterleave_gate_up(b.unsqueeze(-1)).squeeze(-1)
