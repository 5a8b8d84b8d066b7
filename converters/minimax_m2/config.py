"""MiniMax-M2 config resolution: config.json (the vendor release, or transformers 5.23's save) -> `TextConfig`,
every field with its provenance (`config:<key>`, `legacy:<key>`, `default`). Keys and defaults:
docs/minimax-m2.md.

M2 uses plain SwiGLU (`silu(gate) * up`, config `hidden_act: silu`): in SwiGLU-OAI terms alpha 1, beta 0 and
no clamp. Those three values are implied by the activation, never read as defaults of another family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from converters.config_fields import (
    DECODER_POSITIVE_FIELDS,
    DECODER_SHAPE_FIELDS,
    ResolvedConfig,
    check_fixed,
    check_positive,
    check_rules,
    head_and_expert_rules,
    provenance_key,
    read_fields,
    require_object,
    typed,
)
from porter.errors import ConfigError

ARCHITECTURE = "minimax_m2"
MODEL_TYPES = ("minimax_m2",)


@dataclass
class TextConfig(ResolvedConfig):
    """Every field the runtime needs, resolved; `provenance[field]` says where each value came from."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # one routed expert
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    hidden_act: str  # "silu": plain SwiGLU experts
    use_routing_bias: bool  # e_score_correction_bias for selection
    num_mtp_modules: int  # multi-token-prediction layers after the decoder (carried, not run)
    gate_up_interleaved: bool  # a fused source gate_up_proj's rows alternate gate/up
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_id: object
    provenance: dict = field(default_factory=dict)

    # fields that fix tensor shapes: a verify reference that differs here is not the source
    STRUCTURAL: ClassVar[tuple] = DECODER_SHAPE_FIELDS
    # the SwiGLU-OAI parameters of plain SwiGLU (the MoE backends' per-expert gemm1_alpha/beta/clamp_limit)
    swiglu_alpha: ClassVar[float] = 1.0
    swiglu_beta: ClassVar[float] = 0.0
    swiglu_limit: ClassVar[float] = math.inf
    routed_scaling_factor: ClassVar[float] = 1.0  # M2 scales no routed output (transformers, vLLM)

    def is_moe(self, layer: int) -> bool:
        return True  # every decoder layer

    def layer_kind(self, layer: int) -> str:
        return "full/moe"


def manifest_facts(cfg: TextConfig) -> dict:
    """porter.json's architecture records: the name, the activation (plain SwiGLU, and where that came from)
    and what became of the multi-token-prediction layers (docs/artifact-format.md, docs/minimax-m2.md)."""
    implied = f"implied by hidden_act {cfg.hidden_act!r} (plain SwiGLU)"
    return {
        "architecture": ARCHITECTURE,
        "activation": {
            "name": "swiglu",
            "formula": "silu(g) * u",
            "alpha": cfg.swiglu_alpha,
            "beta": cfg.swiglu_beta,
            "limit": None,  # no clamp
            "provenance": {
                "name": cfg.provenance["hidden_act"],
                "alpha": implied,
                "beta": implied,
                "limit": implied,
            },
        },
        "mtp": {
            "modules": cfg.num_mtp_modules,
            "handling": "carried under their source names as read (not run by porter's runtime)",
        },
    }


def source_layout(raw: dict, names) -> str:
    """vendor (per-expert w1/w2/w3: the release, or transformers' save_pretrained) or transformers (its
    in-memory fused names: mlp.experts.gate_up_proj)."""
    return "transformers" if any(n.endswith(".mlp.experts.gate_up_proj") for n in names) else "vendor"


# field -> (key, legacy key, default, kind). Defaults: transformers 5.23 MiniMaxM2Config = the release.
_FIELDS = {
    "vocab_size": ("vocab_size", None, 200064, "int"),
    "hidden_size": ("hidden_size", None, 3072, "int"),
    "num_hidden_layers": ("num_hidden_layers", None, 62, "int"),
    "num_attention_heads": ("num_attention_heads", None, 48, "int"),
    "num_key_value_heads": ("num_key_value_heads", None, 8, "int"),
    "head_dim": ("head_dim", None, 128, "int"),
    "intermediate_size": ("intermediate_size", None, 1536, "int"),
    "num_local_experts": ("num_local_experts", "num_experts", 256, "int"),
    "num_experts_per_tok": ("num_experts_per_tok", None, 8, "int"),
    "rms_norm_eps": ("rms_norm_eps", None, 1e-6, "float"),
    "max_position_embeddings": ("max_position_embeddings", None, 196608, "int"),
    "hidden_act": ("hidden_act", None, "silu", "str"),
    "use_routing_bias": ("use_routing_bias", None, True, "bool"),
    "gate_up_interleaved": ("gate_up_interleaved", None, False, "bool"),
    "tie_word_embeddings": ("tie_word_embeddings", None, False, "bool"),
    "bos_token_id": ("bos_token_id", None, 200034, "tokenid"),
    "eos_token_id": ("eos_token_id", None, 200020, "tokenid"),
}


def resolve_config(raw: dict) -> TextConfig:
    values, prov = _scalars(raw)
    _resolve_rope(raw, values, prov)
    _resolve_mtp(raw, values, prov)
    _resolve_fixed_semantics(raw, values["num_hidden_layers"])
    cfg = TextConfig(**values, provenance=prov)
    _validate(cfg)
    return cfg


def config_sizes(raw: dict) -> dict:
    """The size fields the converter's SIZE_RULES check against the files: {field: (value, config key)},
    read like resolve_config reads them, building nothing from them (porter/format/sizes.py)."""
    from converters.minimax_m2.sizes import SIZE_FIELDS

    values, prov = _scalars(raw)
    _resolve_mtp(raw, values, prov)
    return {f: (values[f], provenance_key(prov[f], f)) for f in SIZE_FIELDS}


def _scalars(raw: dict) -> tuple[dict, dict]:
    """Every field of _FIELDS, typed, with its provenance."""
    require_object(raw)
    if raw.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"config.json: model_type {raw.get('model_type')!r} is not MiniMax-M2 (minimax_m2)")
    return read_fields(raw, _FIELDS)


def _resolve_rope(raw, values, prov):
    """rope_theta (rope_parameters, legacy rope_theta) and the rotary width: the release's legacy
    `rotary_dim`, or transformers' rope_parameters.partial_rotary_factor (it derives one from the other:
    both present must agree); neither -> the full head_dim, as transformers."""
    rope = raw.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError("config field 'rope_parameters' must be an object")
    rope = rope or {}
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise ConfigError(
            "config field 'rope_parameters.rope_type' / 'rope_scaling': only plain RoPE is supported "
            "(MiniMax-M2 uses none)"
        )
    if "rope_theta" in rope:
        values["rope_theta"] = typed("rope_parameters.rope_theta", rope["rope_theta"], "float")
        prov["rope_theta"] = "config:rope_parameters.rope_theta"
    elif "rope_theta" in raw:
        values["rope_theta"], prov["rope_theta"] = (
            typed("rope_theta", raw["rope_theta"], "float"),
            "legacy:rope_theta",
        )
    else:
        values["rope_theta"], prov["rope_theta"] = 5e6, "default"
    head_dim, candidates = values["head_dim"], []
    if "rotary_dim" in raw:
        candidates.append(("legacy:rotary_dim", typed("rotary_dim", raw["rotary_dim"], "int")))
    for key, where in (("partial_rotary_factor", "rope_parameters.partial_rotary_factor"),):
        if key in rope:
            factor = typed(where, rope[key], "float")
            candidates.append((f"config:{where}", int(round(factor * head_dim))))
    if len({v for _, v in candidates}) > 1:
        raise ConfigError(
            "config fields disagree on the rotary width: "
            + ", ".join(f"{k[k.index(':') + 1 :]} -> {v}" for k, v in candidates)
        )
    if candidates:
        prov["rotary_dim"], values["rotary_dim"] = candidates[0]
    else:
        values["rotary_dim"], prov["rotary_dim"] = (
            head_dim,
            "default (head_dim: full-width RoPE, as transformers)",
        )


def _resolve_mtp(raw, values, prov):
    """Multi-token-prediction modules (`model.layers.{L + i}` after the L decoder layers, as vLLM reads
    them): their count when `use_mtp` is not false."""
    n = typed("num_mtp_modules", raw.get("num_mtp_modules", 0), "int")
    if raw.get("use_mtp") is False:
        values["num_mtp_modules"], prov["num_mtp_modules"] = 0, "config:use_mtp (false)"
    else:
        values["num_mtp_modules"] = n
        prov["num_mtp_modules"] = "config:num_mtp_modules" if "num_mtp_modules" in raw else "default"


def _resolve_fixed_semantics(raw: dict, layers: int) -> None:
    """Keys whose only supported value is MiniMax-M2's; anything else would silently change the model."""
    fixed = {
        "hidden_act": ({"silu"}, "'silu' (plain SwiGLU)"),
        "scoring_func": ({"sigmoid"}, "'sigmoid'"),
        "use_qk_norm": ({True}, "true"),
        "qk_norm_type": ({"per_layer"}, "'per_layer' (one RMSNorm over all heads)"),
        "shared_intermediate_size": ({0}, "0 (no shared expert)"),
        "attention_bias": ({False}, "false"),
    }
    check_fixed(raw, fixed, "MiniMax-M2")
    types = raw.get("attn_type_list")
    if types is not None and (
        not isinstance(types, list) or len(types) != layers or any(t != 1 for t in types)
    ):
        raise ConfigError(
            f"config field 'attn_type_list' must be {layers} x 1 (full softmax attention in every layer); "
            "porter implements MiniMax-M2, which has no linear-attention layers"
        )


def _validate(c: TextConfig) -> None:
    positive = DECODER_POSITIVE_FIELDS
    check_positive(c, positive)
    rules = [
        *head_and_expert_rules(c),
        (
            0 < c.rotary_dim <= c.head_dim and c.rotary_dim % 2 == 0,
            "rotary_dim must be even and in (0, head_dim]",
        ),
        (c.rms_norm_eps > 0, "rms_norm_eps must be > 0"),
        (c.rope_theta > 0, "rope_theta must be > 0"),
        (c.num_mtp_modules >= 0, "num_mtp_modules must be >= 0"),
    ]
    check_rules(rules)
