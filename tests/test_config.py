"""Config resolution: each default, each legacy key, provenance, bad values named (docs/minimax-m3.md)."""

import pytest
from tiny_checkpoint import transformers_config, vendor_config

import converters
import converters.minimax_m3 as m3
from porter.errors import ConfigError

arch = converters.get("minimax_m3_vl")  # the MiniMax-M3 converter


def resolve(text_overrides=None, drop=(), flat=False):
    cfg = vendor_config()
    text = cfg["text_config"]
    text.update(text_overrides or {})
    for k in drop:
        text.pop(k, None)
    if flat:
        cfg = transformers_config(text)
    return arch.resolve_config(cfg)


def test_vendor_legacy_keys_resolve_with_provenance():
    c = resolve()
    assert c.layer_types == ["full_attention"] + ["minimax_m3_sparse"] * 3
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 3
    assert (
        c.index_n_heads,
        c.index_head_dim,
        c.index_block_size,
        c.index_topk_blocks,
        c.index_local_blocks,
    ) == (2, 32, 4, 2, 1)
    assert c.provenance["index_block_size"] == "legacy:text_config.sparse_attention_config.sparse_block_size"
    assert c.provenance["mlp_layer_types"] == "legacy:text_config.moe_layer_freq"
    assert c.provenance["layer_types"] == "legacy:text_config.sparse_attention_config.sparse_attention_freq"
    assert c.provenance["rope_theta"] == "legacy:text_config.rope_theta"
    assert c.provenance["hidden_size"] == "config:text_config.hidden_size"
    assert c.rotary_dim == 16 and c.rope_theta == 5e6


def test_flat_transformers_config_resolves_identically():
    a, b = resolve(), resolve(flat=True)
    assert a.to_dict() == b.to_dict()
    assert b.provenance["index_block_size"] == "config:index_block_size"
    assert b.provenance["rotary_dim"] == "config:rope_parameters.partial_rotary_factor"


@pytest.mark.parametrize(
    "field,value",
    [
        ("swiglu_alpha", 1.702),
        ("swiglu_beta", 1.0),
        ("swiglu_limit", 7.0),
        ("routed_scaling_factor", 2.0),
        ("max_position_embeddings", 1048576),
        ("n_shared_experts", 1),
        ("rms_norm_eps", 1e-6),
    ],
)
def test_each_default_and_its_provenance(field, value):
    c = resolve(drop=[field])
    assert getattr(c, field) == value
    assert c.provenance[field] == "default"


def test_swiglu_values_are_read_not_hard_coded():
    c = resolve({"swiglu_alpha": 1.5, "swiglu_beta": 0.25, "swiglu_limit": 3.0})
    assert (c.swiglu_alpha, c.swiglu_beta, c.swiglu_limit) == (1.5, 0.25, 3.0)
    assert c.provenance["swiglu_beta"] == "config:text_config.swiglu_beta"
    assert resolve().provenance["swiglu_beta"] == "default" and resolve().swiglu_beta == 1.0


def test_schedule_defaults_follow_transformers():
    c = resolve(drop=["moe_layer_freq", "sparse_attention_config"])
    assert c.mlp_layer_types == ["sparse"] * 4 and c.provenance["mlp_layer_types"] == "default (all MoE)"
    assert c.layer_types == ["full_attention"] * 4


def test_rotary_width_sources_must_agree():
    with pytest.raises(ConfigError, match="disagree on the rotary width"):
        resolve({"rotary_dim": 8})  # partial_rotary_factor 0.5 * 32 = 16
    c = resolve(drop=["partial_rotary_factor"])
    assert c.rotary_dim == 16 and c.provenance["rotary_dim"] == "config:text_config.rotary_dim"
    c = resolve(drop=["partial_rotary_factor", "rotary_dim"])
    assert c.rotary_dim == 16 and c.provenance["rotary_dim"].startswith("default")


@pytest.mark.parametrize(
    "override,field",
    [
        ({"swiglu_alpha": "1.7"}, "swiglu_alpha"),
        ({"swiglu_beta": None}, "swiglu_beta"),
        ({"hidden_size": 64.0}, "hidden_size"),
        ({"num_local_experts": True}, "num_local_experts"),
        ({"swiglu_limit": -1.0}, "swiglu_limit"),
        ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
        ({"num_key_value_heads": 3}, "num_attention_heads"),
        ({"moe_layer_freq": [0, 1]}, "moe_layer_freq"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_gemma_norm": False}, "use_gemma_norm"),
        ({"qk_norm_type": "per_layer"}, "qk_norm_type"),
        ({"swiglu_alpha": float("nan")}, "swiglu_alpha"),
    ],
)
def test_wrong_type_or_impossible_value_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field):
        resolve(override)


def test_not_minimax_m3():
    cfg = vendor_config()
    cfg["model_type"] = "llama"
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        arch.resolve_config(cfg)


def test_gate_up_round_trip_both_directions():
    import torch

    w = torch.randn(3, 2 * 5, 7)
    assert torch.equal(m3.uninterleave_gate_up(m3.interleave_gate_up(w)), w)
    assert torch.equal(m3.interleave_gate_up(m3.uninterleave_gate_up(w)), w)
    inter = m3.interleave_gate_up(w)
    assert torch.equal(inter[:, 0], w[:, 0]) and torch.equal(inter[:, 1], w[:, 5])  # gate0, up0, ...
    assert torch.equal(inter[:, 3], w[:, 6])  # up1


def test_canonical_names():
    assert (
        arch.canonical_name("language_model.model.layers.3.self_attn.q_proj.weight")
        == "model.layers.3.self_attn.q_proj.weight"
    )
    assert arch.canonical_name("language_model.lm_head.weight") == "lm_head.weight"
    assert (
        arch.canonical_name("model.layers.4.self_attn.indexer.k_norm.weight")
        == "model.layers.4.self_attn.index_k_norm.weight"
    )
    assert (
        arch.canonical_name("model.language_model.layers.4.mlp.gate.e_score_correction_bias")
        == "model.layers.4.block_sparse_moe.e_score_correction_bias"
    )
    assert arch.canonical_name("vision_tower.vision_model.pre_layrnorm.weight") is None
