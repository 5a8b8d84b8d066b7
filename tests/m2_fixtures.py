"""Tiny MiniMax-M2 checkpoints for the tests (examples/minimax_m2_tiny_checkpoint.py), and transformers 5.23's
MiniMaxM2ForCausalLM as the oracle (tests only): 3 layers, 8 experts top-3, hidden 256, expert width 128,
4 q / 2 kv heads of 64 with RoPE on 32 channels, one MTP stand-in layer.

The block-FP8 source is dequantized here by the release's formula (w = q * scale_inv over 128x128 tiles,
then bfloat16, as a reader of the release does), written independently of porter.format.prequantized.
"""

from __future__ import annotations

from pathlib import Path

import torch
from minimax_m2_tiny_checkpoint import TINY_M2, build_m2_checkpoint
from safetensors import safe_open

from porter.format import mxfp8

VOCAB = TINY_M2["vocab_size"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def prompt(n: int, batch: int = 2, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def checkpoint(tmp: Path, layout: str, seed: int = 0) -> Path:
    return build_m2_checkpoint(tmp / f"m2-{layout}-{seed}", layout=layout, seed=seed)


def read_all(path: Path) -> dict:
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def dequantize_release(tensors: dict, block=(128, 128)) -> dict:
    """The FP8 release's weights as bfloat16 values: q * scale_inv expanded over each 128x128 tile."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        s = tensors.get(name + "_scale_inv")
        if s is None:
            out[name] = t
            continue
        n, k = t.shape
        full = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        out[name] = (t.float() * full).bfloat16()
    return out


def hf_model(tensors: dict, config: dict):
    """MiniMaxM2ForCausalLM in fp32 with the given release-named weights (its conversion mapping fuses the
    experts; no text weight may be left random)."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    keys = [
        k for k in config if k not in ("architectures", "model_type", "torch_dtype", "quantization_config")
    ]
    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**{k: config[k] for k in keys})).float().eval()
    with torch.no_grad():
        params = dict(model.named_parameters()) | dict(model.named_buffers())
        for name, p in params.items():
            if ".mlp.experts." in name:
                layer = name.split(".")[2]
                m = f"model.layers.{layer}.block_sparse_moe.experts."
                e = config["num_local_experts"]
                if name.endswith("gate_up_proj"):
                    value = torch.stack(
                        [
                            torch.cat([tensors[m + f"{x}.w1.weight"], tensors[m + f"{x}.w3.weight"]])
                            for x in range(e)
                        ]
                    )
                else:
                    value = torch.stack([tensors[m + f"{x}.w2.weight"] for x in range(e)])
            elif "rotary_emb" in name:
                continue
            else:
                value = tensors[name.replace(".mlp.", ".block_sparse_moe.")]
            assert tuple(value.shape) == tuple(p.shape), name
            p.copy_(value.float())
    return model


def fake_quantize_experts(tensors: dict, scope: str = "experts") -> dict:
    """The weights as porter's MXFP8 conversion leaves them (porter.format.mxfp8 round trip): routed experts,
    and with scope "all" also the attention projections."""
    out = dict(tensors)
    for name, t in tensors.items():
        if ".experts." in name or (scope == "all" and ".self_attn." in name and "_proj." in name):
            out[name] = mxfp8.fake_quantize(t.float())
    return out


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def hf_hidden_states(model, ids) -> list:
    with torch.no_grad():
        return list(model(input_ids=ids, output_hidden_states=True).hidden_states)
