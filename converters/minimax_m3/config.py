"""MiniMax-M3 config resolution: config.json (vendor or transformers layout) -> `TextConfig`, every field
with its provenance (`config:<key>`, `legacy:<key>`, `default`). Keys and defaults: docs/minimax-m3.md.
"""

from __future__ import annotations

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
    lookup,
    provenance_key,
    read_fields,
    require_object,
    typed,
)
from porter.errors import ConfigError

ARCHITECTURE = "minimax_m3"
MODEL_TYPES = ("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3")
SPARSE_ATTN, FULL_ATTN = "minimax_m3_sparse", "full_attention"
MOE_MLP, DENSE_MLP = "sparse", "dense"


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
    dense_intermediate_size: int
    shared_intermediate_size: int
    n_shared_experts: int
    num_local_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    max_position_embeddings: int
    swiglu_alpha: float
    swiglu_beta: float
    swiglu_limit: float
    layer_types: list  # per layer: "minimax_m3_sparse" | "full_attention"
    mlp_layer_types: list  # per layer: "sparse" (MoE) | "dense"
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    index_init_blocks: int
    gate_up_interleaved: bool  # source experts' fused gate/up rows alternate (GPT-OSS convention)
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_id: object
    provenance: dict = field(default_factory=dict)

    # fields that fix tensor shapes: a verify reference that differs here is not the source
    STRUCTURAL: ClassVar[tuple] = (
        *DECODER_SHAPE_FIELDS,
        "dense_intermediate_size",
        "shared_intermediate_size",
        "n_shared_experts",
        "layer_types",
        "mlp_layer_types",
        "index_n_heads",
        "index_head_dim",
    )

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == MOE_MLP

    def is_sparse_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == SPARSE_ATTN

    def layer_kind(self, layer: int) -> str:
        attn = "sparse" if self.is_sparse_attention(layer) else "full"
        return f"{attn}/{'moe' if self.is_moe(layer) else 'dense'}"


def manifest_facts(cfg: TextConfig) -> dict:
    """What porter.json records about this architecture beyond the resolved config: its name and its
    activation, SwiGLU-OAI with its parameters and their provenance (docs/artifact-format.md)."""
    return {
        "architecture": ARCHITECTURE,
        "activation": {
            "name": "swiglu_oai",
            "formula": "min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + beta)",
            "alpha": cfg.swiglu_alpha,
            "beta": cfg.swiglu_beta,
            "limit": cfg.swiglu_limit,
            "provenance": {k: cfg.provenance[f"swiglu_{k}"] for k in ("alpha", "beta", "limit")},
        },
    }


def source_layout(raw: dict, names) -> str:
    """vendor (VL wrapper, legacy keys, per-expert tensors) or transformers (flat text config, fused)."""
    return "transformers" if raw.get("model_type") == "minimax_m3_vl_text" else "vendor"


# field -> (flat key, legacy key path inside text_config, default, kind)
# kind: int | float | bool | tokenid. Defaults are MiniMax-M3's real values (its released config.json), which
# also equal transformers 5.23's class defaults.
_FIELDS = {
    "vocab_size": ("vocab_size", None, 200064, "int"),
    "hidden_size": ("hidden_size", None, 6144, "int"),
    "num_hidden_layers": ("num_hidden_layers", None, 60, "int"),
    "num_attention_heads": ("num_attention_heads", None, 64, "int"),
    "num_key_value_heads": ("num_key_value_heads", None, 4, "int"),
    "head_dim": ("head_dim", None, 128, "int"),
    "intermediate_size": ("intermediate_size", None, 3072, "int"),
    "dense_intermediate_size": ("dense_intermediate_size", None, 12288, "int"),
    "shared_intermediate_size": ("shared_intermediate_size", None, 3072, "int"),
    "n_shared_experts": ("n_shared_experts", None, 1, "int"),
    "num_local_experts": ("num_local_experts", "num_experts", 128, "int"),
    "num_experts_per_tok": ("num_experts_per_tok", None, 4, "int"),
    "routed_scaling_factor": ("routed_scaling_factor", None, 2.0, "float"),
    "rms_norm_eps": ("rms_norm_eps", None, 1e-6, "float"),
    "max_position_embeddings": ("max_position_embeddings", None, 1048576, "int"),
    "swiglu_alpha": ("swiglu_alpha", None, 1.702, "float"),
    "swiglu_beta": ("swiglu_beta", None, 1.0, "float"),
    "swiglu_limit": ("swiglu_limit", None, 7.0, "float"),
    "index_n_heads": ("index_n_heads", "sparse_attention_config.sparse_num_index_heads", 4, "int"),
    "index_head_dim": ("index_head_dim", "sparse_attention_config.sparse_index_dim", 128, "int"),
    "index_block_size": ("index_block_size", "sparse_attention_config.sparse_block_size", 128, "int"),
    "index_topk_blocks": ("index_topk_blocks", "sparse_attention_config.sparse_topk_blocks", 16, "int"),
    "index_local_blocks": ("index_local_blocks", "sparse_attention_config.sparse_local_block", 1, "int"),
    "index_init_blocks": ("index_init_blocks", "sparse_attention_config.sparse_init_block", 0, "int"),
    "gate_up_interleaved": ("gate_up_interleaved", None, False, "bool"),
    "tie_word_embeddings": ("tie_word_embeddings", None, False, "bool"),
    "bos_token_id": ("bos_token_id", None, 200034, "tokenid"),
    "eos_token_id": ("eos_token_id", None, 200020, "tokenid"),
}


def text_config_dict(raw: dict) -> tuple[dict, str]:
    """The text-model part of a config.json and its key prefix (for provenance)."""
    require_object(raw)
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type {model_type!r} is not MiniMax-M3 "
            f"(expected one of {', '.join(MODEL_TYPES)})"
        )
    if "text_config" in raw:
        if not isinstance(raw["text_config"], dict):
            raise ConfigError("config field 'text_config' must be an object")
        return raw["text_config"], "text_config."
    return raw, ""


def resolve_config(raw: dict) -> TextConfig:
    text, prefix = text_config_dict(raw)
    values, prov = _scalars(raw, text, prefix)
    _resolve_rope(text, prefix, values, prov)
    _resolve_layer_types(text, prefix, values, prov)
    _resolve_fixed_semantics(text, prefix, values["layer_types"])
    cfg = TextConfig(**values, provenance=prov)
    _validate(cfg)
    return cfg


def config_sizes(raw: dict) -> dict:
    """The size fields the converter's SIZE_RULES check against the files: {field: (value, config key)},
    read like resolve_config reads them, building nothing from them (porter/format/sizes.py)."""
    from converters.minimax_m3.sizes import SIZE_FIELDS

    text, prefix = text_config_dict(raw)
    values, prov = _scalars(raw, text, prefix)
    return {f: (values[f], provenance_key(prov[f], f)) for f in SIZE_FIELDS}


def _scalars(raw: dict, text: dict, prefix: str) -> tuple[dict, dict]:
    """Every scalar field of _FIELDS, typed, with its provenance; tie_word_embeddings may sit at the top
    level of a VL wrapper's config.json."""

    def top_level_tie(name):
        if name == "tie_word_embeddings" and "tie_word_embeddings" in raw:
            return raw["tie_word_embeddings"], "config:tie_word_embeddings"
        return None

    return read_fields(text, _FIELDS, prefix, top_level_tie)


def _resolve_rope(text, prefix, values, prov):
    head_dim = values["head_dim"]
    rope = text.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError(f"config field '{prefix}rope_parameters' must be an object")
    rope = rope or {}
    if rope.get("rope_type", "default") != "default" or text.get("rope_scaling"):
        raise ConfigError(
            f"config field '{prefix}rope_parameters.rope_type' / 'rope_scaling': only plain "
            "RoPE is supported (MiniMax-M3 uses none)"
        )
    for key, where in (("rope_parameters.rope_theta", "config"), ("rope_theta", "legacy")):
        found, theta = lookup(text, key)
        if found:
            values["rope_theta"] = typed(prefix + key, theta, "float")
            prov["rope_theta"] = f"{where}:{prefix}{key}"
            break
    else:
        values["rope_theta"], prov["rope_theta"] = 5e6, "default"
    # Rotary width. transformers reads only partial_rotary_factor (rope_parameters); the vendor config
    # carries rotary_dim and partial_rotary_factor. When several are present they must agree.
    candidates = []
    for key in ("rope_parameters.partial_rotary_factor", "partial_rotary_factor"):
        found, f = lookup(text, key)
        if found:
            f = typed(prefix + key, f, "float")
            candidates.append((prefix + key, int(round(f * head_dim))))
    if "rotary_dim" in text and not (text.get("model_type") == "minimax_m3_vl_text" and candidates):
        candidates.append((prefix + "rotary_dim", typed(prefix + "rotary_dim", text["rotary_dim"], "int")))
    if not candidates and text.get("model_type") == "minimax_m3_vl_text" and rope:
        candidates.append((prefix + "rope_parameters (no partial_rotary_factor: full width)", head_dim))
    if len({c[1] for c in candidates}) > 1:
        raise ConfigError(
            "config fields disagree on the rotary width: " + ", ".join(f"{k} -> {v}" for k, v in candidates)
        )
    if candidates:
        values["rotary_dim"], prov["rotary_dim"] = candidates[0][1], "config:" + candidates[0][0]
    else:
        values["rotary_dim"], prov["rotary_dim"] = head_dim // 2, "default (head_dim / 2)"


def _per_layer(name, value, n, allowed):
    if not isinstance(value, list) or len(value) != n:
        raise ConfigError(f"config field {name!r} must be a list of {n} entries (num_hidden_layers)")
    bad = [v for v in value if v not in allowed]
    if bad:
        raise ConfigError(
            f"config field {name!r} has entries {bad[:3]!r}; allowed: {sorted(map(str, allowed))}"
        )
    return value


def _resolve_layer_types(text, prefix, values, prov):
    n = values["num_hidden_layers"]
    sparse_cfg = text.get("sparse_attention_config") or {}
    if "layer_types" in text:
        values["layer_types"] = _per_layer(
            prefix + "layer_types", text["layer_types"], n, {SPARSE_ATTN, FULL_ATTN}
        )
        prov["layer_types"] = f"config:{prefix}layer_types"
    elif "sparse_attention_freq" in sparse_cfg:
        key = prefix + "sparse_attention_config.sparse_attention_freq"
        freq = _per_layer(key, sparse_cfg["sparse_attention_freq"], n, {0, 1})
        if sparse_cfg.get("use_sparse_attention", True) is False:
            freq = [0] * n
        values["layer_types"] = [SPARSE_ATTN if f else FULL_ATTN for f in freq]
        prov["layer_types"] = "legacy:" + key
    else:  # as transformers: no schedule -> dense attention everywhere (exact up to topk*block tokens)
        values["layer_types"], prov["layer_types"] = [FULL_ATTN] * n, "default (all full_attention)"
    if "mlp_layer_types" in text:
        values["mlp_layer_types"] = _per_layer(
            prefix + "mlp_layer_types", text["mlp_layer_types"], n, {MOE_MLP, DENSE_MLP}
        )
        prov["mlp_layer_types"] = f"config:{prefix}mlp_layer_types"
    elif "moe_layer_freq" in text:
        freq = _per_layer(prefix + "moe_layer_freq", text["moe_layer_freq"], n, {0, 1})
        values["mlp_layer_types"] = [MOE_MLP if f else DENSE_MLP for f in freq]
        prov["mlp_layer_types"] = f"legacy:{prefix}moe_layer_freq"
    else:
        values["mlp_layer_types"], prov["mlp_layer_types"] = [MOE_MLP] * n, "default (all MoE)"


def _resolve_fixed_semantics(text, prefix, layer_types):
    """Keys whose only supported value is MiniMax-M3's; anything else would silently change the model."""
    fixed = {
        "hidden_act": (
            {"swigluoai", "silu"},
            "swigluoai (transformers writes 'silu' and codes SwiGLU-OAI inline)",
        ),
        "use_gemma_norm": ({True}, "true"),
        "qk_norm_type": ({"per_head"}, "'per_head'"),
        "use_qk_norm": ({True}, "true"),
        "scoring_func": ({"sigmoid"}, "'sigmoid'"),
        "use_routing_bias": ({True}, "true"),
        "attention_output_gate": ({False}, "false"),
        "sparse_attention_config.sparse_score_type": ({"max"}, "'max'"),
    }
    check_fixed(text, fixed, "MiniMax-M3", prefix)
    # per-layer flag: must be set on every sparse-attention layer
    key = "sparse_attention_config.sparse_disable_index_value"
    found, value = lookup(text, key)
    if not found:
        return
    per_layer = value if isinstance(value, list) else [value] * len(layer_types)
    ok = len(per_layer) == len(layer_types) and all(
        v in (1, True) for v, t in zip(per_layer, layer_types) if t == SPARSE_ATTN
    )
    if not ok:
        raise ConfigError(
            f"config field '{prefix}{key}' = {value!r} is not supported: porter implements "
            "MiniMax-M3, which needs 1 on every sparse layer (no index value branch)"
        )


def _validate(c: TextConfig) -> None:
    positive = (
        *DECODER_POSITIVE_FIELDS,
        "index_n_heads",
        "index_head_dim",
        "index_block_size",
        "index_topk_blocks",
    )
    check_positive(c, positive)
    rules = [
        *head_and_expert_rules(c),
        (
            0 < c.rotary_dim <= c.head_dim and c.rotary_dim % 2 == 0,
            "rotary_dim must be even and in (0, head_dim]",
        ),
        (c.swiglu_alpha > 0, "swiglu_alpha must be > 0"),
        (c.swiglu_limit > 0, "swiglu_limit must be > 0"),
        (c.routed_scaling_factor > 0, "routed_scaling_factor must be > 0"),
        (c.rms_norm_eps > 0, "rms_norm_eps must be > 0"),
        (c.rope_theta > 0, "rope_theta must be > 0"),
        (c.n_shared_experts in (0, 1), "n_shared_experts must be 0 or 1"),
        (
            c.index_local_blocks >= 0 and c.index_init_blocks >= 0,
            "index_local_blocks/init_blocks must be >= 0",
        ),
        (
            c.index_local_blocks + c.index_init_blocks <= c.index_topk_blocks,
            "index_local_blocks + index_init_blocks must fit in index_topk_blocks",
        ),
        (
            c.index_n_heads == c.num_key_value_heads or SPARSE_ATTN not in c.layer_types,
            "index_n_heads must equal num_key_value_heads (index head i selects for KV head i)",
        ),
    ]
    check_rules(rules)
    if MOE_MLP in c.mlp_layer_types and c.n_shared_experts and c.shared_intermediate_size <= 0:
        raise ConfigError("config field 'shared_intermediate_size' must be positive")
