"""MiniMax-M3 output plan: every tensor the artifact holds, in write order, from the source headers alone
(canonical names, which linears are quantized, experts stacked or split, gate/up row order), with the
checks that the checkpoint holds what the config describes.
"""

from __future__ import annotations

import re

from converters.block_sparse_moe_names import EXPERTS, PER_EXPERT
from converters.experts import (
    slice_fused_experts,
    split_vendor_experts,
    stack_vendor_experts,
)
from converters.minimax_m3.config import TextConfig
from converters.minimax_m3.hf_layout import LAYOUTS, to_hf_layout
from converters.minimax_m3.names import canonical_name
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

_FUSED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(gate_up_proj|down_proj)$")
_FUSED_GATE_UP = re.compile(
    r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe\.shared_experts))\.gate_up_proj\.weight$"
)

# Linears quantized by `--quantize all` (the vendor MXFP8 release's scope, docs/serving-engines.md).
_ALL_SCOPE = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|index_q|index_k)_proj"
    r"|mlp\.(gate|up|down)_proj|block_sparse_moe\.shared_experts\.(gate|up|down)_proj)\.weight$"
)


def plan_tensors(
    cfg: TextConfig, src_meta: dict, quantize: str = "experts", gate_up: str = "auto", layout: str = "porter"
) -> list[OutTensor]:
    """Every output tensor, in write order, from the source tensor metadata {name: (dtype, shape)}.

    quantize: "experts" (routed experts), "all" (+ every other linear but embeddings, lm_head, router,
    norms), "none". gate_up: "auto" (config's gate_up_interleaved), "interleaved" or "uninterleaved" —
    only meaningful for a fused source gate_up_proj. layout: "porter" (canonical names, stacked experts)
    or "hf" (the vendor release's names and per-expert tensors, which vLLM and sglang load; see
    `to_hf_layout`).
    """
    check_options(quantize, layout, LAYOUTS)
    interleaved = cfg.gate_up_interleaved if gate_up == "auto" else gate_up == "interleaved"
    canon = {}  # canonical -> source name
    carried = []  # non-text tensors, kept as they are
    for src in src_meta:
        c = canonical_name(src)
        if c is None:
            carried.append(src)
        elif c in canon:
            raise LayoutError(
                f"tensors {canon[c]!r} and {src!r} both map to {c!r}; the checkpoint mixes layouts"
            )
        else:
            canon[c] = src
    experts, fused = {}, {}
    plain = []
    for c, src in canon.items():
        if m := PER_EXPERT.match(c):
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
    for c in sorted(by_layer.pop(None, []), key=top_order):
        out.append(_plain(c, canon[c], src_meta, quantize))
    for layer in range(cfg.num_hidden_layers):
        for c in sorted(by_layer.pop(layer, [])):
            out.extend(_plain_or_split(c, canon[c], src_meta, quantize))
        dims, q = (cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size), quantize != "none"
        if layer in experts:
            make = stack_vendor_experts if layout == "porter" else split_vendor_experts
            out.extend(make(EXPERTS, layer, experts[layer], src_meta, dims, q))
        elif layer in fused:
            if layout != "porter":
                _refuse_hf_from_fused(fused[layer])
            out.extend(slice_fused_experts(EXPERTS, layer, fused[layer], src_meta, dims, q, interleaved))
    if by_layer:
        extra = sorted(by_layer)
        raise LayoutError(
            f"tensors for layer(s) {extra} exceed num_hidden_layers={cfg.num_hidden_layers} "
            f"(e.g. {canon[sorted(c for cs in by_layer.values() for c in cs)[0]]!r})"
        )
    out += carried_tensors(carried, src_meta)
    _check_out(cfg, out)
    return out if layout == "porter" else to_hf_layout(cfg, out, quantize)


def _plain(c, src, src_meta, quantize):
    return plain_tensor(c, src, src_meta, quantize, _ALL_SCOPE)


def _plain_or_split(c, src, src_meta, quantize):
    m = _FUSED_GATE_UP.match(c)
    if not m:
        return [_plain(c, src, src_meta, quantize)]
    dtype, shape = src_meta[src]  # fused [2I, H] gate-first -> separate gate_proj / up_proj
    half = shape[0] // 2
    outs = []
    for part, sl in (("gate_proj", slice(0, half)), ("up_proj", slice(half, 2 * half))):
        name = f"{m.group(1)}.{part}.weight"
        outs.append(
            OutTensor(
                name,
                (half, shape[1]),
                dtype,
                [src],
                lambda read, s=sl: read(src)[s],
                quantize=quantize == "all",
            )
        )
    return outs


def _refuse_hf_from_fused(found):
    raise LayoutError(
        f"{found.get('gate_up_proj') or found.get('down_proj')}: --layout hf writes the vendor "
        "release's layout (VL config with text_config, vision tower), which a transformers-layout "
        "source cannot provide; convert the vendor checkpoint, or use --layout porter"
    )


def _check_layers(cfg, canon, experts, fused):
    """Fail before any work if the checkpoint does not hold what the config describes."""
    need = top_level_needs(cfg)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        need += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        need += [
            p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
        ]
        if cfg.is_sparse_attention(layer):
            need += [
                p + f"self_attn.{x}.weight"
                for x in ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")
            ]
        if cfg.is_moe(layer):
            need += [p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.e_score_correction_bias"]
            if layer not in experts and layer not in fused:
                raise LayoutError(
                    f"layer {layer} is MoE in the config but the checkpoint has no expert tensors "
                    f"(model.layers.{layer}.block_sparse_moe.experts.*)"
                )
            if cfg.n_shared_experts:
                need += _gate_up_down(canon, p + "block_sparse_moe.shared_experts.")
        else:
            if layer in experts or layer in fused:
                raise LayoutError(
                    f"layer {layer} is dense in the config but the checkpoint has expert tensors"
                )
            need += _gate_up_down(canon, p + "mlp.")
    require_tensors(need, canon)


def _gate_up_down(canon, prefix):
    if prefix + "gate_up_proj.weight" in canon:
        return [prefix + "gate_up_proj.weight", prefix + "down_proj.weight"]
    return [prefix + x + ".weight" for x in ("gate_proj", "up_proj", "down_proj")]


def _check_out(cfg, out):
    shapes = top_level_shapes(cfg)
    for t in out:
        want = shapes.get(t.name)
        if want and tuple(t.shape) != want:
            raise LayoutError(f"{t.sources[0]}: shape {tuple(t.shape)}, expected {want} from the config")
        if t.quantize and t.shape[-1] % 32:
            raise LayoutError(
                f"{t.sources[0]}: K={t.shape[-1]} is not a multiple of 32, cannot be MXFP8; "
                "use --quantize none or experts"
            )
