"""Build a tiny random MiniMax-M3 checkpoint (the embedded example; also the test fixture).

Same architecture as the 427B release, shrunk: 4 layers (layer 0 dense attention + dense MLP,
layers 1-3 sparse attention + MoE with 8 experts top-2), a real byte-level BPE tokenizer.json trained
in code, and a few vision-tower/projector tensors that must be carried through unchanged.

layout="vendor": the MiniMaxAI release layout (VL wrapper config with legacy keys,
`language_model.model.layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight`).
layout="transformers": transformers 5.23's MiniMaxM3VLForCausalLM layout (flat config, fused
`mlp.experts.gate_up_proj [E, 2I, H]`, `self_attn.indexer.*`). The same seed gives the same weights in
both layouts. gate_up="interleaved" writes the fused gate_up rows GPT-OSS style (gate0, up0, ...).

    python examples/tiny_checkpoint.py OUT_DIR [--layout vendor|transformers]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CORPUS = """MiniMax-M3 is a mixture of experts language model. Each token is routed to four of one hundred
twenty-eight experts, and a shared expert sees every token. porter converts the experts to MXFP8: eight-bit
floating point values with one power-of-two scale for every thirty-two weights. The quick brown fox jumps
over the lazy dog. Engineers who serve giant checkpoints want conversions that are fast and provably right.
Hello world, hello porter, hello experts. The sparse attention keeps the best blocks of keys for each query.
"""

TINY_TEXT = {
    "architectures": ["MiniMaxM3SparseForCausalLM"],
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 64,
    "dense_intermediate_size": 128,
    "shared_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "use_gemma_norm": True,
    "attention_output_gate": False,
    "rope_theta": 5000000.0,
    "rotary_dim": 16,
    "partial_rotary_factor": 0.5,
    "hidden_act": "swigluoai",
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "tie_word_embeddings": False,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "routed_scaling_factor": 2.0,
    "moe_layer_freq": [0, 1, 1, 1],
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "num_mtp_modules": 0,
    "sparse_attention_config": {
        "use_sparse_attention": True,
        "sparse_index_dim": 32,
        "sparse_num_index_heads": 2,
        "sparse_topk_blocks": 2,
        "sparse_block_size": 4,
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": 1,
        "sparse_attention_freq": [0, 1, 1, 1],
        "sparse_disable_index_value": [0, 1, 1, 1],
    },
}


def vendor_config(text_overrides: dict | None = None, bos: int = 1, eos: int = 2) -> dict:
    text = copy.deepcopy(TINY_TEXT)
    text.update(text_overrides or {})
    text.update(bos_token_id=bos, eos_token_id=eos)
    return {
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "model_type": "minimax_m3_vl",
        "torch_dtype": "bfloat16",
        "image_token_index": 3,
        "video_token_index": 4,
        "projector_hidden_size": 64,
        "projector_hidden_act": "gelu",
        "vision_config": {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "patch_size": 14,
        },
        "text_config": text,
    }


def transformers_config(text: dict) -> dict:
    """The flat config transformers 5.23 writes for MiniMaxM3VLForCausalLM (docs/minimax-m3.md, config resolution)."""
    sp = text["sparse_attention_config"]
    flat = {
        k: v
        for k, v in text.items()
        if k
        not in (
            "sparse_attention_config",
            "moe_layer_freq",
            "rope_theta",
            "partial_rotary_factor",
            "architectures",
        )
    }
    flat.update(
        model_type="minimax_m3_vl_text",
        architectures=["MiniMaxM3VLForCausalLM"],
        hidden_act="silu",
        layer_types=["minimax_m3_sparse" if f else "full_attention" for f in sp["sparse_attention_freq"]],
        mlp_layer_types=["sparse" if f else "dense" for f in text["moe_layer_freq"]],
        index_n_heads=sp["sparse_num_index_heads"],
        index_head_dim=sp["sparse_index_dim"],
        index_block_size=sp["sparse_block_size"],
        index_topk_blocks=sp["sparse_topk_blocks"],
        index_local_blocks=sp["sparse_local_block"],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": text["rope_theta"],
            "partial_rotary_factor": text["partial_rotary_factor"],
        },
    )
    return flat


def random_text_weights(text: dict, seed: int) -> dict:
    """Canonical-named random weights (vendor naming without the language_model. prefix)."""
    g = torch.Generator().manual_seed(seed)
    h, v = text["hidden_size"], text["vocab_size"]
    nq, nkv, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    sp = text["sparse_attention_config"]
    nidx, didx = sp["sparse_num_index_heads"], sp["sparse_index_dim"]

    def lin(n, k):  # variance-preserving init so activations stay O(1) through the layers
        return (torch.randn(n, k, generator=g) / k**0.5).bfloat16()

    def norm(n):  # Gemma norms store the delta w of (1 + w)
        return (0.1 * torch.randn(n, generator=g)).bfloat16()

    w = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g).bfloat16(),
        "model.norm.weight": norm(h),
        "lm_head.weight": lin(v, h),
    }
    for layer in range(text["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": lin(nq * d, h),
            p + "self_attn.k_proj.weight": lin(nkv * d, h),
            p + "self_attn.v_proj.weight": lin(nkv * d, h),
            p + "self_attn.o_proj.weight": lin(h, nq * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
        }
        if sp["sparse_attention_freq"][layer]:
            w |= {
                p + "self_attn.index_q_proj.weight": lin(nidx * didx, h),
                p + "self_attn.index_k_proj.weight": lin(didx, h),
                p + "self_attn.index_q_norm.weight": norm(didx),
                p + "self_attn.index_k_norm.weight": norm(didx),
            }
        if text["moe_layer_freq"][layer]:
            e, i, si = text["num_local_experts"], text["intermediate_size"], text["shared_intermediate_size"]
            m = p + "block_sparse_moe."
            w |= {
                m + "gate.weight": torch.randn(e, h, generator=g) / h**0.5,  # fp32 router
                m + "e_score_correction_bias": 0.1 * torch.randn(e, generator=g),  # fp32
                m + "shared_experts.gate_proj.weight": lin(si, h),
                m + "shared_experts.up_proj.weight": lin(si, h),
                m + "shared_experts.down_proj.weight": lin(h, si),
            }
            for x in range(e):
                w |= {
                    m + f"experts.{x}.w1.weight": lin(i, h),
                    m + f"experts.{x}.w3.weight": lin(i, h),
                    m + f"experts.{x}.w2.weight": lin(h, i),
                }
        else:
            di = text["dense_intermediate_size"]
            w |= {
                p + "mlp.gate_proj.weight": lin(di, h),
                p + "mlp.up_proj.weight": lin(di, h),
                p + "mlp.down_proj.weight": lin(h, di),
            }
    return w


def vision_weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "vision_tower.vision_model.embeddings.patch_embedding.weight": torch.randn(
            32, 3, 2, 14, 14, generator=g
        ),
        "vision_tower.vision_model.pre_layrnorm.weight": torch.randn(32, generator=g).bfloat16(),
        "multi_modal_projector.linear_1.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "multi_modal_projector.linear_1.bias": torch.randn(64, generator=g).bfloat16(),
        "patch_merge_mlp.linear_1.weight": torch.randn(64, 256, generator=g).bfloat16(),
    }


def to_vendor_names(w: dict) -> dict:
    out = {}
    for k, t in w.items():
        k = "language_model." + (k if k.startswith("lm_head") else k)
        out[k] = t
    return out


def to_transformers_names(w: dict, text: dict, interleaved: bool = False) -> dict:
    """Fuse to MiniMaxM3VLForCausalLM names (gate_up gate-first, or GPT-OSS interleaved experts)."""
    out = {}
    for k, t in w.items():
        if ".experts." in k or k.endswith("up_proj.weight"):
            continue  # experts are fused below; up_proj joins its gate_proj
        if k.endswith("gate_proj.weight"):  # dense MLP or shared expert: gate_up_proj = [gate; up]
            t = torch.cat([t, w[k.replace("gate_proj", "up_proj")]])
            k = k.replace("gate_proj", "gate_up_proj")
        out[_transformers_name(k)] = t
    for layer in range(text["num_hidden_layers"]):
        m = f"model.layers.{layer}.block_sparse_moe.experts."
        if m + "0.w1.weight" not in w:
            continue
        experts = range(text["num_local_experts"])
        gate_up = torch.stack(
            [torch.cat([w[m + f"{x}.w1.weight"], w[m + f"{x}.w3.weight"]]) for x in experts]
        )
        if interleaved:  # rows gate0, up0, gate1, up1, ... (written here, independently of the converter)
            i = gate_up.shape[-2] // 2
            gate_up = torch.stack([gate_up[:, :i], gate_up[:, i:]], dim=-2).reshape(gate_up.shape)
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up.contiguous()  # [E, 2I, H]
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [w[m + f"{x}.w2.weight"] for x in experts]
        )
    return out


def _transformers_name(k: str) -> str:
    k = k.replace(".self_attn.index_q_", ".self_attn.indexer.q_").replace(
        ".self_attn.index_k_", ".self_attn.indexer.k_"
    )
    k = k.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
    return k.replace(".block_sparse_moe.", ".mlp.")


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


# A chat template in the usual shape (role headers, an end-of-turn token, a generation prompt) over the tiny
# tokenizer's special tokens, so chat prompting runs end to end.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_tiny_checkpoint(
    out_dir,
    layout: str = "vendor",
    seed: int = 0,
    text_overrides: dict | None = None,
    gate_up: str = "uninterleaved",
    max_shard_tensors: int = 40,
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bos, eos = write_tokenizer(out, TINY_TEXT["vocab_size"])
    cfg = vendor_config(text_overrides, bos, eos)
    text = cfg["text_config"]
    weights = random_text_weights(text, seed)
    if layout == "vendor":
        tensors = to_vendor_names(weights) | vision_weights(seed)
    elif layout == "transformers":
        tensors = to_transformers_names(weights, text, interleaved=gate_up == "interleaved")
        cfg = transformers_config(text)  # interleaved rows are marked only if text_overrides says so
    else:
        raise ValueError(f"layout must be vendor or transformers, not {layout!r}")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    save_sharded(tensors, out, max_shard_tensors)
    return out


def write_tokenizer(out: Path, vocab_size: int) -> tuple[int, int]:
    """tokenizer.json (a byte-level BPE of vocab_size) and tokenizer_config.json with the chat template;
    returns the (bos, eos) ids."""
    tok = train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return tok.token_to_id("<s>"), tok.token_to_id("</s>")


def save_sharded(tensors: dict, out: Path, per_shard: int) -> None:
    """`tensors` in shards of per_shard tensors each, with model.safetensors.index.json."""
    names = list(tensors)
    chunks = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    weight_map = {}
    for n, chunk in enumerate(chunks, 1):
        fname = f"model-{n:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in chunk}, str(out / fname), metadata={"format": "pt"})
        weight_map |= {k: fname for k in chunk}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )


def synthetic_overrides(
    num_layers: int, hidden: int = 1024, intermediate: int = 1024, experts: int = 16
) -> dict:
    """text_config overrides for a larger synthetic checkpoint (benchmarks, memory tests): layer 0 dense,
    the rest sparse attention + MoE."""
    sp = copy.deepcopy(TINY_TEXT["sparse_attention_config"])
    sp["sparse_attention_freq"] = [0] + [1] * (num_layers - 1)
    sp["sparse_disable_index_value"] = [0] + [1] * (num_layers - 1)
    return {
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "shared_intermediate_size": intermediate,
        "dense_intermediate_size": 2 * intermediate,
        "num_local_experts": experts,
        "moe_layer_freq": [0] + [1] * (num_layers - 1),
        "sparse_attention_config": sp,
    }


def real_dims_overrides(num_layers: int, experts: int = 8) -> dict:
    """MiniMax-M3's real per-layer dims (docs/minimax-m3.md) with fewer layers and experts (layer 0 dense, the
    rest sparse attention + MoE): for benchmarks at the real layer shapes."""
    o = synthetic_overrides(num_layers, hidden=6144, intermediate=3072, experts=experts)
    o |= {
        "dense_intermediate_size": 12288,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rotary_dim": 64,
        "num_experts_per_tok": min(4, experts),
    }
    o["sparse_attention_config"] |= {
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 4,
        "sparse_block_size": 128,
        "sparse_topk_blocks": 16,
    }
    return o


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layout", choices=["vendor", "transformers"], default="vendor")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build_tiny_checkpoint(args.out_dir, args.layout, args.seed))
