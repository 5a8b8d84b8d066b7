"""Tiny MiniMax-M3 checkpoints for the runtime tests, and transformers 5.23 as the oracle (tests only).

Tiny config (examples/tiny_checkpoint.py): 4 layers (0 dense, 1-3 sparse attention + MoE, 8 experts
top-2), index block 4, top-2 blocks -> dense/sparse threshold at 8 keys.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tiny_checkpoint import TINY_TEXT, build_tiny_checkpoint, transformers_config

from porter.format import mxfp8

SHORT, LONG = 6, 40  # prompt lengths: below topk*block (8) and 5x above it
THRESHOLD = (
    TINY_TEXT["sparse_attention_config"]["sparse_topk_blocks"]
    * TINY_TEXT["sparse_attention_config"]["sparse_block_size"]
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def dequantized(quant):
    """The same MoE layer with its MXFP8 experts dequantized to fp32 and no scales (an unquantized layer)."""
    return replace(
        quant,
        w13_weight=mxfp8.dequantize(quant.w13_weight, quant.w13_weight_scale),
        w13_weight_scale=None,
        w2_weight=mxfp8.dequantize(quant.w2_weight, quant.w2_weight_scale),
        w2_weight_scale=None,
    )


def prompt(n: int, batch: int = 2, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_TEXT["vocab_size"], (batch, n), generator=g)


def left_pad(prompts: list, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D prompts of different lengths as one left-padded batch: ids [B, T] and attention_mask [B, T]
    (1 real token, 0 pad)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = p, 1
    return ids, mask


def vendor_checkpoint(out_dir, seed=0, text_overrides=None):
    return build_tiny_checkpoint(out_dir, layout="vendor", seed=seed, text_overrides=text_overrides)


def hf_vendor_model(path):
    """The VL class loads vendor names with its own conversion mapping; no text weight may be missing."""
    from transformers import MiniMaxM3SparseForConditionalGeneration

    model, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    text_missing = [k for k in info["missing_keys"] if "language_model" in k or k.startswith("lm_head")]
    assert not text_missing, f"transformers left text weights random: {text_missing[:5]}"
    assert not info["mismatched_keys"]
    return model.eval()


def hf_transformers_checkpoint(out_dir, seed=0):
    """MiniMaxM3VLForCausalLM(config) with random weights, written by its own save_pretrained (fused layout)."""
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    flat = transformers_config({**TINY_TEXT, "bos_token_id": 1, "eos_token_id": 2})
    for k in ("model_type", "architectures"):
        flat.pop(k)
    config = MiniMaxM3VLTextConfig(**flat)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:  # variance-preserving, so activations stay O(1)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:  # Gemma norm deltas
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.save_pretrained(str(out_dir))
    return out_dir, model


def hf_text_module(model):
    """The text part of either HF class (MiniMaxM3VLTextModel)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def fake_quantize_hf(model, scope: str = "experts"):
    """Replace HF weights by their MXFP8 round trip (porter.format.mxfp8), the converter's scope:
    experts -> routed experts only; all -> also attention/index projections, dense and shared MLPs."""
    text = hf_text_module(model)
    with torch.no_grad():
        for layer in text.layers:
            mlp = layer.mlp
            if hasattr(mlp, "experts"):
                mlp.experts.gate_up_proj.copy_(
                    mxfp8.fake_quantize(mlp.experts.gate_up_proj)
                )  # blocks along H
                mlp.experts.down_proj.copy_(mxfp8.fake_quantize(mlp.experts.down_proj))  # blocks along I
            if scope != "all":
                continue
            a = layer.self_attn
            lins = [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
            if a.indexer is not None:
                lins += [a.indexer.q_proj, a.indexer.k_proj]
            dense = mlp.shared_experts if hasattr(mlp, "experts") else mlp
            lins += [dense.gate_up_proj, dense.down_proj]
            for lin in lins:
                lin.weight.copy_(mxfp8.fake_quantize(lin.weight))
    return model


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def hf_hidden_states(model, ids) -> list:
    with torch.no_grad():
        return list(model(input_ids=ids, output_hidden_states=True).hidden_states)
