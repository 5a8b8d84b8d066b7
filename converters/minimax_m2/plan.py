"""MiniMax-M2 output plan: every tensor the artifact holds, in write order, from the source headers alone
(canonical names, which linears are quantized, experts stacked or split, gate/up row order), with the
checks that the checkpoint holds what the config describes.
"""

from __future__ import annotations

import re

from converters.block_sparse_moe_names import EXPERTS, PER_EXPERT
from converters.experts import (
    slice_fused_experts,
    split_fused_experts,
    split_vendor_experts,
    stack_vendor_experts,
)
from converters.minimax_m2.config import TextConfig
from converters.minimax_m2.names import canonical_name
from converters.plan_common import (
    carried_tensors,
    check_options,
    plain_tensor,
    require_tensors,
    top_level_needs,
    top_level_shapes,
    top_order,
)
from porter.errors import LayoutError
from porter.format.layout import OutTensor, layer_of

LAYOUTS = ("porter", "hf")
_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(gate_up_proj|down_proj)$")
# Linears quantized by `--quantize all` besides the experts (the vendor FP8 release's scope: every linear
# but the router and lm_head)
_ALL_SCOPE = re.compile(r"^model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.weight$")


def plan_tensors(
    cfg: TextConfig, src_meta: dict, quantize: str = "experts", gate_up: str = "auto", layout: str = "porter"
) -> list[OutTensor]:
    """Every output tensor, in write order, from the source tensor metadata {name: (dtype, shape)}.

    quantize: "experts" (routed experts), "all" (+ the attention projections), "none". gate_up: "auto"
    (config's gate_up_interleaved), "interleaved" or "uninterleaved" — only meaningful for a fused source.
    layout: "porter" (canonical names, stacked experts) or "hf" (the release's names, one 2-D tensor per
    expert, `weight_scale_inv` scales). Multi-token-prediction layers (`model.layers.{L..L+mtp-1}`) are
    carried under their source names as read."""
    check_options(quantize, layout, LAYOUTS)
    interleaved = cfg.gate_up_interleaved if gate_up == "auto" else gate_up == "interleaved"
    canon, carried = _canonical(cfg, src_meta)
    experts, fused, plain = {}, {}, []
    for c, src in canon.items():
        if m := PER_EXPERT.match(c):
            experts.setdefault(int(m.group(1)), {})[(int(m.group(2)), m.group(3))] = src
        elif m := _FUSED_EXPERTS.match(c):
            fused.setdefault(int(m.group(1)), {})[m.group(2)] = src
        else:
            plain.append(c)
    _check_layers(cfg, canon, experts, fused)
    by_layer: dict = {}
    for c in plain:
        by_layer.setdefault(layer_of(c), []).append(c)
    out = [_plain(c, canon[c], src_meta, quantize) for c in sorted(by_layer.pop(None, []), key=top_order)]
    dims, q = (cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size), quantize != "none"
    for layer in range(cfg.num_hidden_layers):
        out += [_plain(c, canon[c], src_meta, quantize) for c in sorted(by_layer.pop(layer, []))]
        if layer in experts:
            make = stack_vendor_experts if layout == "porter" else split_vendor_experts
            out += make(EXPERTS, layer, experts[layer], src_meta, dims, q)
        else:
            make = slice_fused_experts if layout == "porter" else split_fused_experts
            out += make(EXPERTS, layer, fused[layer], src_meta, dims, q, interleaved)
    out += carried_tensors(carried, src_meta)
    _check_out(cfg, out)
    if layout == "hf":  # the same names; scales named X.weight_scale_inv
        for t in out:
            t.layout = "hf" if not t.carried else t.layout
    return out


def _canonical(cfg: TextConfig, src_meta: dict) -> tuple[dict, list]:
    """({canonical: source name}, carried source names): MTP layers and names outside the model carried."""
    canon, carried = {}, []
    last = cfg.num_hidden_layers + cfg.num_mtp_modules
    for src in src_meta:
        c = canonical_name(src)
        layer = layer_of(c) if c is not None else None
        if c is None or (layer is not None and cfg.num_hidden_layers <= layer < last):
            carried.append(src)
        elif layer is not None and layer >= last:
            raise LayoutError(
                f"{src}: layer {layer} exceeds num_hidden_layers={cfg.num_hidden_layers} "
                f"+ num_mtp_modules={cfg.num_mtp_modules}; check that config.json belongs to these weights"
            )
        elif c in canon:
            raise LayoutError(
                f"tensors {canon[c]!r} and {src!r} both map to {c!r}; the checkpoint mixes layouts"
            )
        else:
            canon[c] = src
    return canon, carried


def _plain(c, src, src_meta, quantize):
    return plain_tensor(c, src, src_meta, quantize, _ALL_SCOPE)


def _check_layers(cfg, canon, experts, fused):
    """Fail before any work if the checkpoint does not hold what the config describes."""
    need = top_level_needs(cfg)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        need += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        need += [
            p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ]
        need.append(p + "block_sparse_moe.gate.weight")
        if cfg.use_routing_bias:
            need.append(p + "block_sparse_moe.e_score_correction_bias")
        if layer not in experts and layer not in fused:
            raise LayoutError(
                f"layer {layer}: the checkpoint has no expert tensors "
                f"(model.layers.{layer}.block_sparse_moe.experts.* or mlp.experts.*)"
            )
    require_tensors(need, canon)


def _check_out(cfg, out):
    """Every non-expert tensor's shape against the config (experts are checked when planned)."""
    h, nq, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    e = cfg.num_local_experts
    shapes = top_level_shapes(cfg)
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq * d, h),
        "self_attn.k_proj.weight": (nkv * d, h),
        "self_attn.v_proj.weight": (nkv * d, h),
        "self_attn.o_proj.weight": (h, nq * d),
        "self_attn.q_norm.weight": (nq * d,),  # one RMSNorm over all heads
        "self_attn.k_norm.weight": (nkv * d,),
        "block_sparse_moe.gate.weight": (e, h),
        "block_sparse_moe.e_score_correction_bias": (e,),
    }
    for t in out:
        if t.carried:
            continue
        layer = layer_of(t.name)
        want = shapes.get(t.name) if layer is None else per_layer.get(t.name.split(".", 3)[3])
        if want and tuple(t.shape) != want:
            raise LayoutError(f"{t.sources[0]}: shape {tuple(t.shape)}, expected {want} from the config")
        if t.quantize and t.shape[-1] % 32:
            raise LayoutError(
                f"{t.sources[0]}: K={t.shape[-1]} is not a multiple of 32, cannot be MXFP8; "
                "use --quantize none or experts"
            )
