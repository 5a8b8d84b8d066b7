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
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from porter.errors import PorterError
from porter.format import mxfp8
from porter.format.layout import HF_LAYOUT_PREFIX as HF_PREFIX, OutTensor, layer_of

ARCHITECTURE = "minimax_m3"
MODEL_TYPES = ("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3")
SPARSE_ATTN, FULL_ATTN = "minimax_m3_sparse", "full_attention"
MOE_MLP, DENSE_MLP = "sparse", "dense"


class ConfigError(PorterError, ValueError):
    """A config field is missing, of the wrong type or impossible (the message names it)."""


class LayoutError(PorterError, ValueError):
    """A tensor is missing, unexpected or of the wrong shape (the message names it)."""


# ----------------------------------------------------------------------------------------------------
# Config resolution


@dataclass
class TextConfig:
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("provenance")
        return d

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == MOE_MLP

    def is_sparse_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == SPARSE_ATTN


def manifest_facts(cfg: TextConfig) -> dict:
    """What porter.json records about this architecture beyond the resolved config: its name and the
    SwiGLU-OAI parameters with their provenance (verify compares them; docs/artifact-format.md)."""
    return {"architecture": ARCHITECTURE,
            "swiglu": {"alpha": cfg.swiglu_alpha, "beta": cfg.swiglu_beta, "limit": cfg.swiglu_limit,
                       "provenance": {k: cfg.provenance[f"swiglu_{k}"] for k in ("alpha", "beta", "limit")}}}


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


def _lookup(cfg: dict, path: str):
    node = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _typed(name: str, value, kind: str):
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"config field {name!r} must be a finite number, got {value!r}")
        value = float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise ConfigError(f"config field {name!r} must be true or false, got {value!r}")
    if kind == "tokenid" and value is not None:
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError(f"config field {name!r} must be a token id or a list of them, got {value!r}")
    return value


def text_config_dict(raw: dict) -> tuple[dict, str]:
    """The text-model part of a config.json and its key prefix (for provenance)."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"config.json: model_type {model_type!r} is not MiniMax-M3 "
                          f"(expected one of {', '.join(MODEL_TYPES)})")
    if "text_config" in raw:
        if not isinstance(raw["text_config"], dict):
            raise ConfigError("config field 'text_config' must be an object")
        return raw["text_config"], "text_config."
    return raw, ""


def resolve_config(raw: dict) -> TextConfig:
    text, prefix = text_config_dict(raw)
    values, prov = {}, {}
    for name, (flat, legacy, default, kind) in _FIELDS.items():
        found, value = _lookup(text, flat)
        where = f"config:{prefix}{flat}"
        if not found and legacy:
            found, value = _lookup(text, legacy)
            where = f"legacy:{prefix}{legacy}"
        if not found and name == "tie_word_embeddings" and "tie_word_embeddings" in raw:
            found, value, where = True, raw["tie_word_embeddings"], "config:tie_word_embeddings"
        if not found:
            value, where = default, "default"
        values[name] = _typed(f"{prefix}{flat}", value, kind)
        prov[name] = where
    _resolve_rope(text, prefix, values, prov)
    _resolve_layer_types(text, prefix, values, prov)
    _resolve_fixed_semantics(text, prefix, values["layer_types"])
    cfg = TextConfig(**values, provenance=prov)
    _validate(cfg)
    return cfg


def _resolve_rope(text, prefix, values, prov):
    head_dim = values["head_dim"]
    rope = text.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ConfigError(f"config field '{prefix}rope_parameters' must be an object")
    rope = rope or {}
    if rope.get("rope_type", "default") != "default" or text.get("rope_scaling"):
        raise ConfigError(f"config field '{prefix}rope_parameters.rope_type' / 'rope_scaling': only plain "
                          "RoPE is supported (MiniMax-M3 uses none)")
    for key, where in (("rope_parameters.rope_theta", "config"), ("rope_theta", "legacy")):
        found, theta = _lookup(text, key)
        if found:
            values["rope_theta"] = _typed(prefix + key, theta, "float")
            prov["rope_theta"] = f"{where}:{prefix}{key}"
            break
    else:
        values["rope_theta"], prov["rope_theta"] = 5e6, "default"
    # Rotary width. transformers reads only partial_rotary_factor (rope_parameters); the vendor config
    # carries rotary_dim and partial_rotary_factor. When several are present they must agree.
    candidates = []
    for key in ("rope_parameters.partial_rotary_factor", "partial_rotary_factor"):
        found, f = _lookup(text, key)
        if found:
            f = _typed(prefix + key, f, "float")
            candidates.append((prefix + key, int(round(f * head_dim))))
    if "rotary_dim" in text and not (text.get("model_type") == "minimax_m3_vl_text" and candidates):
        candidates.append((prefix + "rotary_dim", _typed(prefix + "rotary_dim", text["rotary_dim"], "int")))
    if not candidates and text.get("model_type") == "minimax_m3_vl_text" and rope:
        candidates.append((prefix + "rope_parameters (no partial_rotary_factor: full width)", head_dim))
    if len({c[1] for c in candidates}) > 1:
        raise ConfigError("config fields disagree on the rotary width: " +
                          ", ".join(f"{k} -> {v}" for k, v in candidates))
    if candidates:
        values["rotary_dim"], prov["rotary_dim"] = candidates[0][1], "config:" + candidates[0][0]
    else:
        values["rotary_dim"], prov["rotary_dim"] = head_dim // 2, "default (head_dim / 2)"


def _per_layer(name, value, n, allowed):
    if not isinstance(value, list) or len(value) != n:
        raise ConfigError(f"config field {name!r} must be a list of {n} entries (num_hidden_layers)")
    bad = [v for v in value if v not in allowed]
    if bad:
        raise ConfigError(f"config field {name!r} has entries {bad[:3]!r}; allowed: {sorted(map(str, allowed))}")
    return value


def _resolve_layer_types(text, prefix, values, prov):
    n = values["num_hidden_layers"]
    sparse_cfg = text.get("sparse_attention_config") or {}
    if "layer_types" in text:
        values["layer_types"] = _per_layer(prefix + "layer_types", text["layer_types"], n, {SPARSE_ATTN, FULL_ATTN})
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
        values["mlp_layer_types"] = _per_layer(prefix + "mlp_layer_types", text["mlp_layer_types"], n,
                                               {MOE_MLP, DENSE_MLP})
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
        "hidden_act": ({"swigluoai", "silu"}, "swigluoai (transformers writes 'silu' and codes SwiGLU-OAI inline)"),
        "use_gemma_norm": ({True}, "true"),
        "qk_norm_type": ({"per_head"}, "'per_head'"),
        "use_qk_norm": ({True}, "true"),
        "scoring_func": ({"sigmoid"}, "'sigmoid'"),
        "use_routing_bias": ({True}, "true"),
        "attention_output_gate": ({False}, "false"),
        "sparse_attention_config.sparse_score_type": ({"max"}, "'max'"),
        "sparse_attention_config.sparse_disable_index_value": (None, "1 on every sparse layer (no index value branch)"),
    }
    for key, (allowed, want) in fixed.items():
        found, value = _lookup(text, key)
        if not found:
            continue
        if allowed is None:  # per-layer flag: must be set on every sparse-attention layer
            per_layer = value if isinstance(value, list) else [value] * len(layer_types)
            ok = len(per_layer) == len(layer_types) and all(
                v in (1, True) for v, t in zip(per_layer, layer_types) if t == SPARSE_ATTN)
        else:
            ok = any(value == a and type(value) is type(a) for a in allowed)
        if not ok:
            raise ConfigError(f"config field '{prefix}{key}' = {value!r} is not supported: porter implements "
                              f"MiniMax-M3, which needs {want}")


def _validate(c: TextConfig) -> None:
    positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "num_local_experts", "num_experts_per_tok", "index_n_heads",
                "index_head_dim", "index_block_size", "index_topk_blocks", "max_position_embeddings"]
    for name in positive:
        if getattr(c, name) <= 0:
            raise ConfigError(f"config field {name!r} must be positive, got {getattr(c, name)}")
    rules = [
        (c.num_attention_heads % c.num_key_value_heads == 0,
         "num_attention_heads must be a multiple of num_key_value_heads"),
        (c.num_experts_per_tok <= c.num_local_experts, "num_experts_per_tok must not exceed num_local_experts"),
        (0 < c.rotary_dim <= c.head_dim and c.rotary_dim % 2 == 0, "rotary_dim must be even and in (0, head_dim]"),
        (c.swiglu_alpha > 0, "swiglu_alpha must be > 0"),
        (c.swiglu_limit > 0, "swiglu_limit must be > 0"),
        (c.routed_scaling_factor > 0, "routed_scaling_factor must be > 0"),
        (c.rms_norm_eps > 0, "rms_norm_eps must be > 0"),
        (c.rope_theta > 0, "rope_theta must be > 0"),
        (c.n_shared_experts in (0, 1), "n_shared_experts must be 0 or 1"),
        (c.index_local_blocks >= 0 and c.index_init_blocks >= 0, "index_local_blocks/init_blocks must be >= 0"),
        (c.index_local_blocks + c.index_init_blocks <= c.index_topk_blocks,
         "index_local_blocks + index_init_blocks must fit in index_topk_blocks"),
        (c.index_n_heads == c.num_key_value_heads or SPARSE_ATTN not in c.layer_types,
         "index_n_heads must equal num_key_value_heads (index head i selects for KV head i)"),
    ]
    for ok, msg in rules:
        if not ok:
            raise ConfigError("config: " + msg)
    if MOE_MLP in c.mlp_layer_types and c.n_shared_experts and c.shared_intermediate_size <= 0:
        raise ConfigError("config field 'shared_intermediate_size' must be positive")


# ----------------------------------------------------------------------------------------------------
# Tensor names


def canonical_name(src: str) -> Optional[str]:
    """Source tensor name -> canonical text-model name, or None for tensors outside the text model."""
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("model.language_model.", "model.")):
        if src.startswith(old):
            src = new + src[len(old):]
            break
    else:
        if not (src.startswith("model.layers.") or src.startswith("model.embed_tokens.")
                or src.startswith("model.norm.") or src.startswith("lm_head.")):
            return None
    if src.startswith("model.mtp."):
        return None  # MTP heads are carried under their source name, not run
    # transformers-native spellings -> vendor spellings
    src = re.sub(r"\.self_attn\.indexer\.([qk])_(proj|norm)\.", r".self_attn.index_\1_\2.", src)
    src = src.replace(".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")
    src = src.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    src = src.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")
    src = src.replace(".mlp.experts.", ".block_sparse_moe.experts.")
    return src


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(gate_up_proj|down_proj)$")
_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe\.shared_experts))\.gate_up_proj\.weight$")

# Linears quantized by `--quantize all` (the vendor MXFP8 release's scope, docs/serving-engines.md).
_ALL_SCOPE = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|index_q|index_k)_proj"
                        r"|mlp\.(gate|up|down)_proj|block_sparse_moe\.shared_experts\.(gate|up|down)_proj)\.weight$")


def experts_w13_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w13_weight"


def experts_w2_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w2_weight"


_STACKED_EXPERTS = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.experts\.(w13|w2)_weight$")


def is_stacked_experts(name: str) -> bool:
    """A canonical stacked expert tensor ([E, 2I, H] w13 or [E, H, I] w2)."""
    return bool(_STACKED_EXPERTS.match(name))


def uninterleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[..., 2I, H] rows gate0, up0, gate1, up1, ... (GPT-OSS) -> [gate; up]."""
    return torch.cat([w[..., 0::2, :], w[..., 1::2, :]], dim=-2)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[..., 2I, H] [gate; up] -> rows gate0, up0, gate1, up1, ... (inverse of uninterleave_gate_up)."""
    i = w.shape[-2] // 2
    return torch.stack([w[..., :i, :], w[..., i:, :]], dim=-2).reshape(w.shape)


def plan_tensors(cfg: TextConfig, src_meta: dict, quantize: str = "experts",
                 gate_up: str = "auto", layout: str = "porter") -> list[OutTensor]:
    """Every output tensor, in write order, from the source tensor metadata {name: (dtype, shape)}.

    quantize: "experts" (routed experts), "all" (+ every other linear but embeddings, lm_head, router,
    norms), "none". gate_up: "auto" (config's gate_up_interleaved), "interleaved" or "uninterleaved" —
    only meaningful for a fused source gate_up_proj. layout: "porter" (canonical names, stacked experts)
    or "hf" (the vendor release's names and per-expert tensors, which vLLM and sglang load; see
    `to_hf_layout`).
    """
    if quantize not in ("experts", "all", "none"):
        raise PorterError(f"--quantize must be experts, all or none, not {quantize!r}")
    if layout not in LAYOUTS:
        raise PorterError(f"--layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    interleaved = cfg.gate_up_interleaved if gate_up == "auto" else gate_up == "interleaved"
    canon = {}  # canonical -> source name
    carried = []  # non-text tensors, kept as they are
    for src in src_meta:
        c = canonical_name(src)
        if c is None:
            carried.append(src)
        elif c in canon:
            raise LayoutError(f"tensors {canon[c]!r} and {src!r} both map to {c!r}; the checkpoint mixes layouts")
        else:
            canon[c] = src
    experts, fused = {}, {}
    plain = []
    for c, src in canon.items():
        if m := _EXPERT.match(c):
            experts.setdefault(int(m.group(1)), {})[(int(m.group(2)), m.group(3))] = src
        elif m := _FUSED_EXPERTS.match(c):
            fused.setdefault(int(m.group(1)), {})[m.group(2)] = src
        else:
            plain.append(c)
    _check_layers(cfg, canon, experts, fused)
    out: list[OutTensor] = []
    by_layer: dict = {}
    for c in plain:
        by_layer.setdefault(layer_of(c), []).append(c)
    for c in sorted(by_layer.pop(None, []), key=_top_order):
        out.append(_plain(c, canon[c], src_meta, quantize))
    for layer in range(cfg.num_hidden_layers):
        for c in sorted(by_layer.pop(layer, [])):
            out.extend(_plain_or_split(c, canon[c], src_meta, quantize))
        if layer in experts:
            make = _stack_experts if layout == "porter" else _split_vendor_experts
            out.extend(make(cfg, layer, experts[layer], src_meta, quantize))
        elif layer in fused:
            make = _fused_experts if layout == "porter" else _split_fused_experts
            out.extend(make(cfg, layer, fused[layer], src_meta, quantize, interleaved))
    if by_layer:
        extra = sorted(by_layer)
        raise LayoutError(f"tensors for layer(s) {extra} exceed num_hidden_layers={cfg.num_hidden_layers} "
                          f"(e.g. {canon[sorted(c for cs in by_layer.values() for c in cs)[0]]!r})")
    for src in sorted(carried):
        dtype, shape = src_meta[src]
        out.append(OutTensor(src, tuple(shape), dtype, [src], _read_one(src), carried=True))
    _check_out(cfg, out)
    return out if layout == "porter" else to_hf_layout(cfg, out, quantize)


def _top_order(name):
    return {"model.embed_tokens.weight": 0, "model.norm.weight": 1, "lm_head.weight": 2}.get(name, 3), name


def _read_one(src):
    return lambda read: read(src)


def _plain(c, src, src_meta, quantize):
    dtype, shape = src_meta[src]
    q = quantize == "all" and bool(_ALL_SCOPE.match(c))
    return OutTensor(c, tuple(shape), dtype, [src], _read_one(src), quantize=q)


def _plain_or_split(c, src, src_meta, quantize):
    m = _FUSED_GATE_UP.match(c)
    if not m:
        return [_plain(c, src, src_meta, quantize)]
    dtype, shape = src_meta[src]  # fused [2I, H] gate-first -> separate gate_proj / up_proj
    half = shape[0] // 2
    outs = []
    for part, sl in (("gate_proj", slice(0, half)), ("up_proj", slice(half, 2 * half))):
        name = f"{m.group(1)}.{part}.weight"
        outs.append(OutTensor(name, (half, shape[1]), dtype, [src], lambda read, s=sl: read(src)[s],
                              quantize=quantize == "all"))
    return outs


def _stack_experts(cfg, layer, found, src_meta, quantize):
    _check_vendor_experts(cfg, layer, found, src_meta)
    e_count, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    dtype = src_meta[found[(0, "w1")]][0]
    q = quantize != "none"
    w13_src = [found[(e, w)] for e in range(e_count) for w in ("w1", "w3")]
    w2_src = [found[(e, "w2")] for e in range(e_count)]
    # w1 = gate, w3 = up -> [gate; up]. Experts are built one at a time, as row parts (no concat copy).
    w13 = OutTensor(experts_w13_name(layer), (e_count, 2 * i, h), dtype, w13_src,
                    read_expert_rows=lambda read, e: [read(found[(e, "w1")]), read(found[(e, "w3")])],
                    quantize=q)
    w2 = OutTensor(experts_w2_name(layer), (e_count, h, i), dtype, w2_src,
                   read_expert_rows=lambda read, e: [read(found[(e, "w2")])], quantize=q)
    return [w13, w2]


def _check_vendor_experts(cfg, layer, found, src_meta):
    e_count = cfg.num_local_experts
    missing = [f"experts.{e}.{w}" for e in range(e_count) for w in ("w1", "w2", "w3") if (e, w) not in found]
    extra = [f"experts.{e}.{w}" for (e, w) in found if e >= e_count]
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise LayoutError(f"layer {layer}: expert tensors {what} (config num_local_experts={e_count})")
    h, i = cfg.hidden_size, cfg.intermediate_size
    for (e, w), src in found.items():
        want = (h, i) if w == "w2" else (i, h)
        if tuple(src_meta[src][1]) != want:
            raise LayoutError(f"{src}: shape {tuple(src_meta[src][1])}, expected {want} from the config")


def _check_fused_experts(cfg, layer, found, src_meta) -> dict:
    e_count, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    want = {"gate_up_proj": (e_count, 2 * i, h), "down_proj": (e_count, h, i)}
    for part, shape in want.items():
        if part not in found:
            raise LayoutError(f"layer {layer}: missing mlp.experts.{part}")
        if tuple(src_meta[found[part]][1]) != shape:
            raise LayoutError(f"{found[part]}: shape {tuple(src_meta[found[part]][1])}, expected {shape} "
                              "from the config")
    return want


def _fused_experts(cfg, layer, found, src_meta, quantize, interleaved):
    want = _check_fused_experts(cfg, layer, found, src_meta)
    gu, dn = found["gate_up_proj"], found["down_proj"]
    fix = uninterleave_gate_up if interleaved else (lambda w: w)
    q = quantize != "none"
    # read(name, e) reads only expert e's slice of the fused tensor
    w13 = OutTensor(experts_w13_name(layer), want["gate_up_proj"], src_meta[gu][0], [gu],
                    read_expert_rows=lambda read, e: [fix(read(gu, e))], quantize=q)
    w2 = OutTensor(experts_w2_name(layer), want["down_proj"], src_meta[dn][0], [dn],
                   read_expert_rows=lambda read, e: [read(dn, e)], quantize=q)
    return [w13, w2]


def _split_vendor_experts(cfg, layer, found, src_meta, quantize):
    """hf layout: each expert's w1 (gate), w3 (up), w2 (down) as its own 2-D tensor, never stacked."""
    _check_vendor_experts(cfg, layer, found, src_meta)
    out = []
    for e in range(cfg.num_local_experts):
        for w in ("w1", "w2", "w3"):
            src = found[(e, w)]
            dtype, shape = src_meta[src]
            out.append(OutTensor(expert_name(layer, e, w), tuple(shape), dtype, [src], _read_one(src),
                                 quantize=quantize != "none"))
    return out


def _split_fused_experts(cfg, layer, found, src_meta, quantize, interleaved):
    raise LayoutError(f"{found.get('gate_up_proj') or found.get('down_proj')}: --layout hf writes the vendor "
                      "release's layout (VL config with text_config, vision tower), which a transformers-layout "
                      "source cannot provide; convert the vendor checkpoint, or use --layout porter")


def _check_layers(cfg, canon, experts, fused):
    """Fail before any work if the checkpoint does not hold what the config describes."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        need.append("lm_head.weight")
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        need += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        need += [p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        if cfg.is_sparse_attention(layer):
            need += [p + f"self_attn.{x}.weight" for x in ("index_q_proj", "index_k_proj", "index_q_norm",
                                                           "index_k_norm")]
        if cfg.is_moe(layer):
            need += [p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.e_score_correction_bias"]
            if layer not in experts and layer not in fused:
                raise LayoutError(f"layer {layer} is MoE in the config but the checkpoint has no expert tensors "
                                  f"(model.layers.{layer}.block_sparse_moe.experts.*)")
            if cfg.n_shared_experts:
                need += _gate_up_down(canon, p + "block_sparse_moe.shared_experts.")
        else:
            if layer in experts or layer in fused:
                raise LayoutError(f"layer {layer} is dense in the config but the checkpoint has expert tensors")
            need += _gate_up_down(canon, p + "mlp.")
    missing = [n for n in need if n not in canon]
    if missing:
        raise LayoutError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[0]!r}; "
                          "check that config.json belongs to these weights")


def _gate_up_down(canon, prefix):
    if prefix + "gate_up_proj.weight" in canon:
        return [prefix + "gate_up_proj.weight", prefix + "down_proj.weight"]
    return [prefix + x + ".weight" for x in ("gate_proj", "up_proj", "down_proj")]


def _check_out(cfg, out):
    h = cfg.hidden_size
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for t in out:
        want = shapes.get(t.name)
        if want and tuple(t.shape) != want:
            raise LayoutError(f"{t.sources[0]}: shape {tuple(t.shape)}, expected {want} from the config")
        if t.quantize and t.shape[-1] % 32:
            raise LayoutError(f"{t.sources[0]}: K={t.shape[-1]} is not a multiple of 32, cannot be MXFP8; "
                              "use --quantize none or experts")


# ----------------------------------------------------------------------------------------------------
# The hf layout: the vendor release's names, which vLLM and sglang load (docs/serving-engines.md).
#   language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w1/w2/w3.weight   F8_E4M3 [N, K], never stacked
#   <module>.weight (F8_E4M3 [N, K]) + <module>.weight_scale_inv (U8 [N, K/32]) for every quantized linear
#   config.json: the vendor `architectures`; `quantization_config` at the top level (sglang reads only there)

LAYOUTS = ("porter", "hf")
# --quantize default per layout: the hf layout's groups (shared + routed experts) must share one format,
# so it defaults to the vendor MXFP8 release's scope.
DEFAULT_SCOPE = {"porter": "experts", "hf": "all"}
HF_ARCHITECTURES = ["MiniMaxM3SparseForConditionalGeneration"]
_TEXT_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|index_q|index_k)_proj|mlp\.(gate|up|down)_proj"
                          r"|block_sparse_moe\.(gate|shared_experts\.(gate|up|down)_proj|experts\.\d+\.w[123]))\.weight$"
                          r"|^lm_head\.weight$")


def expert_name(layer: int, e: int, w: str) -> str:
    """Canonical name of one expert's 2-D weight: w1 gate, w3 up, w2 down."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"


def hf_name(canonical: str) -> str:
    """Canonical text-model name -> hf layout name (the vendor `language_model.` prefix)."""
    return HF_PREFIX + canonical


def to_hf_layout(cfg: TextConfig, out: list, quantize: str) -> list:
    """Rename a canonical plan (experts already per-expert) to hf names, after checking format groups."""
    _check_format_groups(cfg, out, quantize)
    for t in out:
        if not t.carried:
            t.name = hf_name(t.name)
    return out


def _format_groups(cfg: TextConfig, layer: int) -> list:
    """(label, canonical weight names, why they must share one format) for one decoder layer."""
    p = f"model.layers.{layer}."
    attn = ["q", "k", "v"] + (["index_q", "index_k"] if cfg.is_sparse_attention(layer) else [])
    groups = [("/".join(attn) + " projections", [p + f"self_attn.{x}_proj.weight" for x in attn],
               "vLLM loads them into one fused qkv_proj parameter whose format q/k/v decide")]
    if cfg.is_moe(layer):
        shared = [p + f"block_sparse_moe.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
        groups.append(("the shared expert and the routed experts", shared + [expert_name(layer, 0, "w1")],
                       "sglang fuses the shared expert into the routed experts"))
    else:
        groups.append(("gate/up projections", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                       "both engines load them into one fused gate_up_proj parameter"))
    return groups


def _check_format_groups(cfg: TextConfig, out: list, quantize: str) -> None:
    quantized = {t.name: t.quantize for t in out}
    for layer in range(cfg.num_hidden_layers):
        for label, names, why in _format_groups(cfg, layer):
            if len({quantized[n] for n in names if n in quantized}) > 1:
                raise LayoutError(f"--layout hf with --quantize {quantize} would give {label} of layer {layer} "
                                  f"different formats, but {why}; use --quantize all (the vendor release's "
                                  "scope) or none")


def hf_ignored_layers(out: list) -> list:
    """Unfused full module paths of the text-model linears left unquantized, `lm_head` always included
    (vLLM quantizes lm_head unless it is listed). The engines match these against their module prefixes."""
    names = [t.name[: -len(".weight")] for t in out
             if not t.quantize and _TEXT_LINEAR.match(t.name.removeprefix(HF_PREFIX))]
    lm_head = hf_name("lm_head")
    return names if lm_head in names else names + [lm_head]


def hf_quantization_config(out: list, quantize: str, scale_rounding: str) -> Optional[dict]:
    """The top-level config.json `quantization_config` of an hf-layout artifact (None when nothing is
    quantized: the artifact is then a plain bf16 checkpoint). One list under both ignore keys (vLLM reads
    `ignored_layers`, sglang the first of the two present); no `moe_quant_*` keys (they switch sglang to
    NVFP4)."""
    if quantize == "none":
        return None
    ignored = hf_ignored_layers(out)
    return {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, mxfp8.BLOCK],
            "fmt": "e4m3", "scale_fmt": "ue8m0", "ignored_layers": ignored, "modules_to_not_convert": list(ignored),
            "porter": {"layout": "hf", "scope": quantize, "scale_rounding": scale_rounding}}


def check_hf_source(raw: dict, where: str = "config.json") -> None:
    """--layout hf needs the vendor config (VL wrapper with text_config) to write the vendor layout."""
    if raw.get("model_type") != "minimax_m3_vl" or not isinstance(raw.get("text_config"), dict):
        raise ConfigError(f"{where}: --layout hf writes the vendor release's layout (model_type minimax_m3_vl "
                          f"with text_config), but this source is {raw.get('model_type')!r}; convert the vendor "
                          "checkpoint, or use --layout porter")


def hf_config_json(raw: dict, qconfig: Optional[dict]) -> dict:
    """The source's config.json as the hf layout's: vendor architectures, the source's own quantization
    (if it was pre-quantized) replaced by what porter wrote, at the top level only."""
    check_hf_source(raw)
    resolved = resolve_config(raw)
    cfg = json.loads(json.dumps(raw))
    cfg["architectures"] = list(HF_ARCHITECTURES)
    # vLLM reads text_config.swiglu_beta (and alpha, limit) without a default: write the resolved values
    for key in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"):
        cfg["text_config"].setdefault(key, getattr(resolved, key))
    cfg.pop("quantization_config", None)
    cfg["text_config"].pop("quantization_config", None)
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    return cfg


def hf_canonical_map(names) -> dict:
    """hf-layout tensor names -> the canonical view the runtime reads: {canonical: hf name} for plain
    tensors and scales (`weight_scale_inv` -> `weight_scale`), {canonical: [[hf row parts] per expert]} for
    the stacked experts (w13 = [w1; w3], w2), built by the loader when touched."""
    out, experts = {}, {}
    for n in names:
        if not n.startswith(HF_PREFIX):
            continue  # vision tower, projector: not read by the text runtime
        c = n[len(HF_PREFIX):]
        is_scale = c.endswith(".weight_scale_inv")
        weight = c[: -len("_scale_inv")] if is_scale else c
        if m := _EXPERT.match(weight):
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, is_scale), {})[(e, w)] = n
            continue
        out[c[: -len("_inv")] if is_scale else c] = n
    for (layer, is_scale), found in experts.items():
        count = 1 + max(e for e, _ in found)
        suffix = "_scale" if is_scale else ""
        for stacked, parts in ((experts_w13_name(layer), ("w1", "w3")), (experts_w2_name(layer), ("w2",))):
            missing = [f"{e}.{w}" for e in range(count) for w in parts if (e, w) not in found]
            if missing:
                raise LayoutError(f"hf-layout artifact lacks expert tensor experts.{missing[0]} of layer {layer}")
            out[stacked + suffix] = [[found[(e, w)] for w in parts] for e in range(count)]
    return out
