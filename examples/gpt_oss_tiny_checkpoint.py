"""Build a tiny random gpt-oss checkpoint (a fixture for tests and the examples; benchmarks build real sizes).

The architecture of gpt-oss-20b / -120b shrunk: 4 layers alternating sliding-window (window 4 here) and full
attention with learned sinks and biases, YaRN RoPE, 8 experts top-2 with biases and gate/up interleaved,
a byte-level BPE tokenizer trained in code with the harmony special tokens, and a harmony chat template.

layout="mxfp4": OpenAI's release layout — config.json with the release's keys (`rope_scaling`,
`experts_per_token`, `quantization_config: {quant_method: mxfp4}`), experts as `*_blocks` (two E2M1 codes
per byte, low nibble first) + `*_scales` (UE8M0 per 32) in `[E, out, in]` order (porter.format.mxfp4).
layout="bf16": transformers 5.23's layout — flat config with `rope_parameters`, bf16 experts
`gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]` (`[in, out]`), as GptOssForCausalLM.save_pretrained writes
them. Its expert weights are Gaussian (not on the MXFP4 grid), so converting it quantizes for real.

    python examples/gpt_oss_tiny_checkpoint.py OUT_DIR [--layout mxfp4|bf16] [--seed N]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from tiny_checkpoint import save_sharded

from porter.format import mxfp4

CORPUS = """gpt-oss is a mixture of experts language model from OpenAI. Each token is routed to four of
thirty-two experts; attention alternates between a sliding window of one hundred twenty-eight tokens and the
full context, and every head has a learned sink. porter converts the experts from MXFP4 to MXFP8 exactly:
every four-bit value times its block scale is an eight-bit value times the same scale. The quick brown fox
jumps over the lazy dog. Hello world, hello porter, hello experts.
"""
# harmony's special tokens (OpenAI's o200k_harmony), first in the tiny vocabulary
HARMONY_TOKENS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]

TINY = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 8,
    "experts_per_token": 2,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 2048,  # = original 64 x factor 32, as the release's 131072 = 4096 x 32
    "initial_context_length": 64,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "swiglu_limit": 7.0,
    "rope_theta": 150000,
    # YaRN over a short original context so the tiny prompts cross the interpolated frequencies
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.9,
    "output_router_logits": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}
# openai/gpt-oss-20b's config.json (the release's keys: rope_scaling + rope_theta, experts_per_token and
# num_experts_per_tok, no swiglu_alpha); benchmarks/whole_model.py builds a random model of this config
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}
# o200k_harmony's special tokens at their ids in the release's tokenizer
HARMONY_IDS = {
    "<|startoftext|>": 199998,
    "<|endoftext|>": 199999,
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
}
MXFP4_QUANTIZATION = {  # the release's quantization_config
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def release_config(overrides: dict | None = None, eos: int = 2, pad: int = 1) -> dict:
    """The MXFP4 release's config.json shape (legacy rope_scaling + rope_theta, both experts-per-token keys)."""
    cfg = copy.deepcopy(TINY) | (overrides or {})
    n = cfg["num_hidden_layers"]
    cfg["layer_types"] = (["sliding_attention", "full_attention"] * n)[:n]
    return cfg | {"eos_token_id": eos, "pad_token_id": pad, "quantization_config": MXFP4_QUANTIZATION}


def transformers_config(release: dict) -> dict:
    """What transformers 5.23 writes for the same model: rope_parameters (theta inside), no quantization."""
    flat = {
        k: v for k, v in release.items() if k not in ("rope_scaling", "rope_theta", "quantization_config")
    }
    flat["rope_parameters"] = release["rope_scaling"] | {"rope_theta": float(release["rope_theta"])}
    flat.pop("experts_per_token", None)
    return flat


def random_weights(cfg: dict, seed: int, layout: str) -> dict:
    """Release-named tensors. Expert weights: MXFP4 blocks + scales (layout mxfp4) or Gaussian bf16 in
    transformers' [E, in, out] orientation (layout bf16)."""
    g = torch.Generator().manual_seed(seed)
    h, v, e, i = cfg["hidden_size"], cfg["vocab_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def lin(n, k):  # variance-preserving, so activations stay O(1) through the layers
        return (torch.randn(n, k, generator=g) / k**0.5).bfloat16()

    def vec(n, scale=0.1, mean=0.0):
        return (mean + scale * torch.randn(n, generator=g)).bfloat16()

    w = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g).bfloat16(),
        "model.norm.weight": vec(h, 0.1, 1.0),  # plain RMSNorm: the weight multiplies
        "lm_head.weight": lin(v, h),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w |= {
            p + "input_layernorm.weight": vec(h, 0.1, 1.0),
            p + "post_attention_layernorm.weight": vec(h, 0.1, 1.0),
            p + "self_attn.q_proj.weight": lin(nq * d, h),
            p + "self_attn.q_proj.bias": vec(nq * d),
            p + "self_attn.k_proj.weight": lin(nkv * d, h),
            p + "self_attn.k_proj.bias": vec(nkv * d),
            p + "self_attn.v_proj.weight": lin(nkv * d, h),
            p + "self_attn.v_proj.bias": vec(nkv * d),
            p + "self_attn.o_proj.weight": lin(h, nq * d),
            p + "self_attn.o_proj.bias": vec(h),
            p + "self_attn.sinks": vec(nq, 1.0),  # learned per-head sink logits, O(1) so they matter
            p + "mlp.router.weight": lin(e, h),
            p + "mlp.router.bias": vec(e),
            p + "mlp.experts.gate_up_proj_bias": vec(e * 2 * i, 0.5).reshape(e, 2 * i),  # interleaved
            p + "mlp.experts.down_proj_bias": vec(e * h).reshape(e, h),
        }
        x = p + "mlp.experts."
        if layout == "mxfp4":  # [E, out, in]: gate/up rows interleaved; scales near 2^-5 (|w| ~ 0.1)
            for name, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
                codes = torch.randint(0, 16, (e, n, k // 32, 32), generator=g)
                w[x + name + "_blocks"] = mxfp4.pack(codes)
                w[x + name + "_scales"] = torch.randint(121, 124, (e, n, k // 32), generator=g).to(
                    torch.uint8
                )
        else:  # [E, in, out] Gaussian
            w[x + "gate_up_proj"] = (torch.randn(e, h, 2 * i, generator=g) / h**0.5).bfloat16()
            w[x + "down_proj"] = (torch.randn(e, i, h, generator=g) / i**0.5).bfloat16()
    return w


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=HARMONY_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok


def word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer over the whole vocabulary (`w<id>`), the harmony tokens at their
    release ids: text for a real-size checkpoint, where a trained BPE would need a real corpus."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    names = {i: f"w{i}" for i in range(vocab_size)} | {i: t for t, i in HARMONY_IDS.items() if i < vocab_size}
    tok = Tokenizer(models.WordLevel({t: i for i, t in names.items()}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True) for t, i in HARMONY_IDS.items() if i < vocab_size])
    return tok


# A harmony chat template in the shape of gpt-oss's own (system message with the date and reasoning effort,
# an optional developer message, user / assistant turns on channels, a generation prompt), using what that
# template needs from the renderer: strftime_now, namespace(), macros, tojson, raise_exception, slicing.
CHAT_TEMPLATE = """{%- macro system_message() -%}
{{- (model_identity if model_identity is defined else "You are a tiny model.") + "\\n" }}
{{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
{{- "Reasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" + system_message() + "<|end|>" }}
{%- if messages[0].role in ("developer", "system") %}
{{- "<|start|>developer<|message|># Instructions\\n\\n" + messages[0].content + "<|end|>" }}
{%- set rest = messages[1:] %}
{%- else %}
{%- set rest = messages %}
{%- endif %}
{%- set last = namespace(tool=none) %}
{%- for m in rest %}
{%- if m.role == "assistant" %}
{%- if "tool_calls" in m %}
{%- set call = m.tool_calls[0].function if m.tool_calls[0].function else m.tool_calls[0] %}
{{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
{{- call.arguments|tojson + "<|call|>" }}
{%- set last.tool = call.name %}
{%- else %}
{{- "<|start|>assistant<|channel|>final<|message|>" + m.content + "<|end|>" }}
{%- endif %}
{%- elif m.role == "tool" %}
{%- if last.tool is none %}{{- raise_exception("a tool message needs an assistant tool call before it") }}{% endif %}
{{- "<|start|>functions." + last.tool + " to=assistant<|channel|>commentary<|message|>" }}
{{- m.content|tojson + "<|end|>" }}
{%- else %}
{{- "<|start|>user<|message|>" + m.content + "<|end|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def build_tiny_checkpoint(
    out_dir, layout: str = "mxfp4", seed: int = 0, overrides: dict | None = None, max_shard_tensors: int = 40
) -> Path:
    if layout not in ("mxfp4", "bf16"):
        raise ValueError(f"layout must be mxfp4 or bf16, not {layout!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(TINY["vocab_size"])
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in HARMONY_TOKENS}
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|startoftext|>",
                "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    cfg = release_config(overrides, eos=ids["<|return|>"], pad=ids["<|endoftext|>"])
    weights = random_weights(cfg, seed, layout)
    if layout == "bf16":
        cfg = transformers_config(cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": ids["<|startoftext|>"],
                "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"]],
                "pad_token_id": ids["<|endoftext|>"],
            }
        )
    )
    save_sharded(weights, out, max_shard_tensors)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layout", choices=["mxfp4", "bf16"], default="mxfp4")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(build_tiny_checkpoint(args.out_dir, args.layout, args.seed))
