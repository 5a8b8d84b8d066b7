"""Build a tiny random MiniMax-M2 checkpoint in code (no download), in the real source layouts.

layout="fp8": the release's format — every attention and expert linear FP8 e4m3 with a float32
`X.weight_scale_inv` per 128x128 block (`quantization_config: quant_method fp8, weight_block_size [128, 128]`,
the router, norms, embeddings and lm_head unquantized), the release's config keys (legacy `rotary_dim`,
`use_routing_bias`, `scoring_func`, `attn_type_list`, MTP keys).
layout="vendor": the same names and config in bf16 (also what transformers 5.23's save_pretrained writes).
layout="transformers": transformers' in-memory names (fused `mlp.experts.gate_up_proj [E, 2I, H]`
[gate; up], `mlp.experts.down_proj`, `mlp.gate.weight`, `mlp.e_score_correction_bias`) and its config keys
(`rope_parameters.partial_rotary_factor`, no `rotary_dim`).
The same seed gives the same weights in every layout (fp8: their block-FP8 rounding). Dims are tiny but keep
the structure: every layer MoE, top-k of 8 experts, q/k norms over all heads, partial RoPE, and one MTP
layer (stand-in tensors, carried by porter, not run).

    python examples/minimax_m2_tiny_checkpoint.py OUT_DIR [--layout fp8|vendor|transformers]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from tiny_checkpoint import save_sharded, write_tokenizer

FP8_BLOCK = [128, 128]
TINY_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "vocab_size": 384,
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rotary_dim": 32,
    "rope_theta": 5000000.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "num_local_experts": 8,
    "num_experts_per_tok": 3,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "shared_intermediate_size": 0,
    "attn_type_list": [1, 1, 1],
    "use_mtp": True,
    "num_mtp_modules": 1,
    "mtp_transformer_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def config(overrides: dict | None = None, bos: int = 1, eos: int = 2) -> dict:
    """The release-style config.json."""
    cfg = copy.deepcopy(TINY_M2)
    cfg.update(overrides or {})
    if "num_hidden_layers" in (overrides or {}) and "attn_type_list" not in (overrides or {}):
        cfg["attn_type_list"] = [1] * cfg["num_hidden_layers"]
    return cfg | {"bos_token_id": bos, "eos_token_id": eos}


def transformers_config(cfg: dict) -> dict:
    """The keys transformers 5.23 reads (rope_parameters with partial_rotary_factor, no rotary_dim)."""
    keep = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "head_dim max_position_embeddings rms_norm_eps hidden_act num_local_experts num_experts_per_tok "
        "tie_word_embeddings bos_token_id eos_token_id"
    ).split()
    out = {k: cfg[k] for k in keep} | {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"]}
    out["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": cfg["rope_theta"],
        "partial_rotary_factor": cfg["rotary_dim"] / cfg["head_dim"],
    }
    return out


def random_weights(cfg: dict, seed: int) -> dict:
    """Canonical (release) names -> random weights: bf16 linears, norms and embeddings; the router bf16,
    e_score_correction_bias fp32 (as the release)."""
    g = torch.Generator().manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    e, i = cfg["num_local_experts"], cfg["intermediate_size"]

    def lin(n, k):  # variance-preserving init so activations stay O(1) through the layers
        return (torch.randn(n, k, generator=g) / k**0.5).bfloat16()

    def norm(n):  # plain RMSNorm weights (y * w), around 1
        return (1.0 + 0.1 * torch.randn(n, generator=g)).bfloat16()

    w = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g).bfloat16(),
        "model.norm.weight": norm(h),
        "lm_head.weight": lin(v, h),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p, m = f"model.layers.{layer}.", f"model.layers.{layer}.block_sparse_moe."
        w |= {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": lin(nq * d, h),
            p + "self_attn.k_proj.weight": lin(nkv * d, h),
            p + "self_attn.v_proj.weight": lin(nkv * d, h),
            p + "self_attn.o_proj.weight": lin(h, nq * d),
            p + "self_attn.q_norm.weight": norm(nq * d),  # one RMSNorm over all heads
            p + "self_attn.k_norm.weight": norm(nkv * d),
            m + "gate.weight": lin(e, h),
            m + "e_score_correction_bias": 0.1 * torch.randn(e, generator=g),
        }
        for x in range(e):
            w |= {
                m + f"experts.{x}.w1.weight": lin(i, h),
                m + f"experts.{x}.w3.weight": lin(i, h),
                m + f"experts.{x}.w2.weight": lin(h, i),
            }
    return w


def mtp_weights(cfg: dict, seed: int) -> dict:
    """Stand-ins for the multi-token-prediction layers (`model.layers.{L + i}`, as the engines read them):
    porter carries them under their names and never runs them."""
    g = torch.Generator().manual_seed(seed + 1)
    h, out = cfg["hidden_size"], {}
    for k in range(cfg["num_mtp_modules"] if cfg.get("use_mtp", True) else 0):
        p = f"model.layers.{cfg['num_hidden_layers'] + k}."
        out |= {
            p + "enorm.weight": torch.ones(h).bfloat16(),
            p + "hnorm.weight": torch.ones(h).bfloat16(),
            p + "eh_proj.weight": (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).bfloat16(),
        }
    return out


def fp8_block_quantize(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)]) with w ~ q * scale_inv per
    block (amax / 448 scales, as the release's block-FP8 quantizer)."""
    bn, bk = block
    n, k = w.shape
    pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    pad[:n, :k] = w.float()
    tiles = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [N/bn, K/bk]
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(pad.shape)[:n, :k]
    return q.contiguous(), scale.float()


def _fp8_quantized(name: str) -> bool:
    """The release's FP8 scope: every linear but the router and lm_head (modules_to_not_convert)."""
    return name.endswith(".weight") and (".self_attn." in name and "_proj." in name or ".experts." in name)


def to_fp8(w: dict) -> dict:
    out = {}
    for name, t in w.items():
        if _fp8_quantized(name) or name.endswith("eh_proj.weight"):
            q, s = fp8_block_quantize(t)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = t
    return out


def fp8_quantization_config() -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "float8_e4m3fn",
        "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    }


def to_transformers_names(w: dict, cfg: dict) -> dict:
    """transformers' in-memory MiniMaxM2ForCausalLM names: experts fused gate_up_proj [E, 2I, H] = [w1; w3]."""
    out = {}
    for k, t in w.items():
        if ".experts." not in k:
            out[k.replace(".block_sparse_moe.", ".mlp.")] = t
    for layer in range(cfg["num_hidden_layers"]):
        m, experts = f"model.layers.{layer}.block_sparse_moe.", range(cfg["num_local_experts"])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[m + f"experts.{x}.w1.weight"], w[m + f"experts.{x}.w3.weight"]]) for x in experts]
        )
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [w[m + f"experts.{x}.w2.weight"] for x in experts]
        )
    return out


def build_m2_checkpoint(
    out_dir, layout: str = "fp8", seed: int = 0, overrides: dict | None = None, max_shard_tensors: int = 60
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos = write_tokenizer(out, TINY_M2["vocab_size"])
    cfg = config(overrides, bos, eos)
    weights = random_weights(cfg, seed)
    if layout == "fp8":
        tensors = to_fp8(weights | mtp_weights(cfg, seed))
        cfg["quantization_config"] = fp8_quantization_config()
    elif layout == "vendor":
        tensors = weights | mtp_weights(cfg, seed)
    elif layout == "transformers":
        tensors, cfg = to_transformers_names(weights, cfg), transformers_config(cfg)
    else:
        raise ValueError(f"layout must be fp8, vendor or transformers, not {layout!r}")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    save_sharded(tensors, out, max_shard_tensors)
    return out


def real_dims_overrides(num_layers: int, experts: int = 8) -> dict:
    """MiniMax-M2's real per-layer dims (docs/minimax-m2.md) with fewer layers and experts: for benchmarks."""
    return {
        "num_hidden_layers": num_layers,
        "hidden_size": 3072,
        "intermediate_size": 1536,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rotary_dim": 64,
        "num_local_experts": experts,
        "num_experts_per_tok": min(8, experts),
        "num_mtp_modules": 0,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layout", choices=["fp8", "vendor", "transformers"], default="fp8")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build_m2_checkpoint(args.out_dir, args.layout, args.seed))
