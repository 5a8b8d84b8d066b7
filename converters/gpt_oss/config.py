"""gpt-oss config resolution: config.json (the OpenAI release's keys or transformers 5.23's) -> `GptOssConfig`,
every field with its provenance (`config:<key>`, `legacy:<key>`, `default ...`, `architecture ...`).
Keys, defaults and where each comes from: docs/gpt-oss.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from converters.config_fields import (
    DECODER_POSITIVE_FIELDS,
    DECODER_SHAPE_FIELDS,
    ResolvedConfig,
    check_positive,
    check_rules,
    head_and_expert_rules,
    provenance_key,
    require_object,
    typed,
)
from porter.errors import ConfigError

ARCHITECTURE = "gpt_oss"
MODEL_TYPES = ("gpt_oss",)
SLIDING_ATTN, FULL_ATTN = "sliding_attention", "full_attention"
ROPE_TYPES = ("yarn", "default")


@dataclass
class GptOssConfig(ResolvedConfig):
    """Every field the runtime needs, resolved; `provenance[field]` says where each value came from."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # one expert
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float
    max_position_embeddings: int
    sliding_window: int
    layer_types: list  # per layer: "sliding_attention" | "full_attention"
    attention_bias: bool
    swiglu_alpha: float
    swiglu_beta: float
    swiglu_limit: float
    rope_type: str  # "yarn" | "default"
    rope_theta: float
    rope_factor: float
    rope_beta_fast: float
    rope_beta_slow: float
    rope_original_max_position_embeddings: int
    rope_truncate: bool
    rope_attention_factor: float  # cos/sin are multiplied by it (YaRN's attention scaling)
    gate_up_interleaved: bool  # the release's gate/up rows (and bias entries) alternate gate0, up0, ...
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_id: object
    provenance: dict = field(default_factory=dict)

    # fields that fix tensor shapes: a verify reference that differs here is not the source
    STRUCTURAL: ClassVar[tuple] = DECODER_SHAPE_FIELDS

    def is_moe(self, layer: int) -> bool:
        return True  # every gpt-oss layer's MLP is the routed experts

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING_ATTN

    def layer_kind(self, layer: int) -> str:
        return f"{'sliding' if self.is_sliding(layer) else 'full'}/moe"

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # gpt-oss rotates every channel (transformers has no partial factor for it)


def manifest_facts(cfg: GptOssConfig) -> dict:
    """porter.json's architecture records: the name and the experts' activation, SwiGLU-OAI with its
    parameters and their provenance (docs/artifact-format.md)."""
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
    """release (OpenAI's MXFP4 experts) or transformers (bf16 experts, [E, in, out])."""
    q = raw.get("quantization_config")
    return (
        "release (MXFP4 experts)"
        if isinstance(q, dict) and q.get("quant_method") == "mxfp4"
        else "transformers"
    )


# field -> (keys in order of preference: (key, "config" | "legacy"), default, kind). Defaults are
# transformers 5.23 GptOssConfig's (which are gpt-oss-120b's; gpt-oss-20b's config.json gives its own).
_T5 = "default (transformers GptOssConfig)"
_FIELDS = {
    "vocab_size": ((("vocab_size", "config"),), 201088, "int"),
    "hidden_size": ((("hidden_size", "config"),), 2880, "int"),
    "num_hidden_layers": ((("num_hidden_layers", "config"),), 36, "int"),
    "num_attention_heads": ((("num_attention_heads", "config"),), 64, "int"),
    "num_key_value_heads": ((("num_key_value_heads", "config"),), 8, "int"),
    "head_dim": ((("head_dim", "config"),), 64, "int"),
    "intermediate_size": ((("intermediate_size", "config"),), 2880, "int"),
    "num_local_experts": ((("num_local_experts", "config"), ("num_experts", "legacy")), 128, "int"),
    "num_experts_per_tok": ((("num_experts_per_tok", "config"), ("experts_per_token", "legacy")), 4, "int"),
    "rms_norm_eps": ((("rms_norm_eps", "config"),), 1e-5, "float"),
    "max_position_embeddings": ((("max_position_embeddings", "config"),), 131072, "int"),
    "sliding_window": ((("sliding_window", "config"),), 128, "int"),
    "attention_bias": ((("attention_bias", "config"),), True, "bool"),
    "swiglu_alpha": ((("swiglu_alpha", "config"),), 1.702, "float"),
    "swiglu_limit": ((("swiglu_limit", "config"),), 7.0, "float"),
    "tie_word_embeddings": ((("tie_word_embeddings", "config"),), False, "bool"),
    "bos_token_id": ((("bos_token_id", "config"),), None, "tokenid"),
    "eos_token_id": ((("eos_token_id", "config"),), None, "tokenid"),
}


def _check_model_type(raw) -> None:
    require_object(raw)
    if raw.get("model_type") not in MODEL_TYPES:
        raise ConfigError(
            f"config.json: model_type {raw.get('model_type')!r} is not gpt-oss (expected {', '.join(MODEL_TYPES)})"
        )


def resolve_config(raw: dict) -> GptOssConfig:
    values, prov = _scalars(raw)
    values["swiglu_beta"] = 1.0  # gpt-oss computes (up + 1): not a config key anywhere
    prov["swiglu_beta"] = "architecture (gpt-oss: (up + 1); transformers GptOssExperts._apply_gate)"
    values["gate_up_interleaved"] = True
    prov["gate_up_interleaved"] = "architecture (gpt-oss: gate = gu[..., ::2], up = gu[..., 1::2])"
    _resolve_layer_types(raw, values, prov)
    _resolve_rope(raw, values, prov)
    cfg = GptOssConfig(**values, provenance=prov)
    _validate(cfg)
    return cfg


def config_sizes(raw: dict) -> dict:
    """The size fields the converter's SIZE_RULES check against the files: {field: (value, config key)},
    read like resolve_config reads them, building nothing from them (porter/format/sizes.py)."""
    from converters.gpt_oss.sizes import SIZE_FIELDS

    values, prov = _scalars(raw)
    return {f: (values[f], provenance_key(prov[f], f)) for f in SIZE_FIELDS}


def _scalars(raw: dict) -> tuple[dict, dict]:
    """Every field of _FIELDS, typed, with its provenance."""
    _check_model_type(raw)
    values, prov = {}, {}
    for name, (keys, default, kind) in _FIELDS.items():
        found = [(k, where) for k, where in keys if k in raw]
        if not found:
            values[name], prov[name] = default, _T5 if default is not None else "default (none)"
            continue
        given = {k: typed(k, raw[k], kind) for k, _ in found}
        if len(set(map(repr, given.values()))) > 1:  # the release writes both experts_per_token and
            raise ConfigError(  # num_experts_per_tok: they must agree
                "config fields disagree: " + ", ".join(f"{k} = {v!r}" for k, v in given.items())
            )
        key, where = found[0]
        values[name], prov[name] = given[key], f"{where}:{key}"
    return values, prov


def _resolve_layer_types(raw, values, prov):
    n = values["num_hidden_layers"]
    if "layer_types" not in raw:  # transformers: sliding on even layers, full on odd ones
        values["layer_types"] = [SLIDING_ATTN if i % 2 == 0 else FULL_ATTN for i in range(n)]
        prov["layer_types"] = "default (transformers GptOssConfig: sliding, full, sliding, ...)"
        return
    lt = raw["layer_types"]
    if not isinstance(lt, list) or len(lt) != n:
        raise ConfigError(f"config field 'layer_types' must be a list of {n} entries (num_hidden_layers)")
    bad = [t for t in lt if t not in (SLIDING_ATTN, FULL_ATTN)]
    if bad:
        raise ConfigError(
            f"config field 'layer_types' has entries {bad[:3]!r}; allowed: {SLIDING_ATTN!r}, {FULL_ATTN!r}"
        )
    values["layer_types"], prov["layer_types"] = list(lt), "config:layer_types"


# rope_parameters key -> (field, default when the dict lacks it, kind); transformers 5.23
# modeling_rope_utils._compute_yarn_parameters' defaults (truncate True, betas 32 / 1)
_ROPE_KEYS = {
    "factor": ("rope_factor", None, "float"),
    "beta_fast": ("rope_beta_fast", 32.0, "float"),
    "beta_slow": ("rope_beta_slow", 1.0, "float"),
    "original_max_position_embeddings": ("rope_original_max_position_embeddings", None, "int"),
    "truncate": ("rope_truncate", True, "bool"),
    "attention_factor": ("rope_attention_factor", None, "float"),
}
# transformers' GptOssConfig when config.json has no RoPE keys at all (gpt-oss's own values)
_ROPE_DEFAULT = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _resolve_rope(raw, values, prov):
    if isinstance(raw.get("rope_parameters"), dict):
        rope, where = raw["rope_parameters"], "config:rope_parameters."
    elif isinstance(raw.get("rope_scaling"), dict):
        rope, where = raw["rope_scaling"], "legacy:rope_scaling."
    elif raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        rope, where = _ROPE_DEFAULT, "default (transformers GptOssConfig rope_parameters) "
    else:
        raise ConfigError("config field 'rope_parameters' (or legacy 'rope_scaling') must be an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"config field 'rope_parameters.rope_type' = {rope_type!r} is not supported for gpt-oss "
            f"(porter implements {', '.join(ROPE_TYPES)})"
        )
    unsupported = [
        k for k in ("mscale", "mscale_all_dim", "partial_rotary_factor") if rope.get(k) is not None
    ]
    if unsupported:
        raise ConfigError(f"config field 'rope_parameters.{unsupported[0]}' is not supported for gpt-oss")
    values["rope_type"], prov["rope_type"] = rope_type, where + "rope_type"
    if "rope_theta" in rope:
        values["rope_theta"], prov["rope_theta"] = (
            typed("rope_theta", rope["rope_theta"], "float"),
            where + "rope_theta",
        )
    elif "rope_theta" in raw:
        values["rope_theta"], prov["rope_theta"] = (
            typed("rope_theta", raw["rope_theta"], "float"),
            "legacy:rope_theta",
        )
    else:
        values["rope_theta"], prov["rope_theta"] = 150000.0, _T5 + " default_theta"
    for key, (name, default, kind) in _ROPE_KEYS.items():
        if rope.get(key) is not None:
            values[name], prov[name] = typed(f"rope_parameters.{key}", rope[key], kind), where + key
        else:
            values[name], prov[name] = default, "default (transformers _compute_yarn_parameters)"
    if values["rope_original_max_position_embeddings"] is None:  # transformers standardize_rope_params
        values["rope_original_max_position_embeddings"] = values["max_position_embeddings"]
        prov["rope_original_max_position_embeddings"] = "default (max_position_embeddings)"
    if values["rope_factor"] is None:
        values["rope_factor"] = (
            values["max_position_embeddings"] / values["rope_original_max_position_embeddings"]
        )
        prov["rope_factor"] = "default (max_position_embeddings / original_max_position_embeddings)"
    if rope_type == "default":  # plain RoPE: no interpolation, no scaling of cos/sin
        values["rope_factor"], values["rope_attention_factor"] = 1.0, 1.0
        prov["rope_factor"] = prov["rope_attention_factor"] = "rope_type default"
    elif values["rope_attention_factor"] is None:  # YaRN: 0.1 ln(factor) + 1
        f = values["rope_factor"]
        values["rope_attention_factor"] = 1.0 if f <= 1 else 0.1 * math.log(f) + 1.0
        prov["rope_attention_factor"] = "default (YaRN: 0.1 * ln(factor) + 1)"


def _validate(c: GptOssConfig) -> None:
    positive = (*DECODER_POSITIVE_FIELDS, "sliding_window", "rope_original_max_position_embeddings")
    check_positive(c, positive)
    rules = [
        *head_and_expert_rules(c),
        (c.head_dim % 2 == 0, "head_dim must be even (RoPE rotates pairs)"),
        (c.swiglu_alpha > 0, "swiglu_alpha must be > 0"),
        (c.swiglu_limit > 0, "swiglu_limit must be > 0"),
        (c.rms_norm_eps > 0, "rms_norm_eps must be > 0"),
        (c.rope_theta > 0, "rope_theta must be > 0"),
        (c.rope_factor > 0, "rope_parameters.factor must be > 0"),
    ]
    check_rules(rules)
