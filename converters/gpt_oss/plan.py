"""gpt-oss output plan: every tensor the artifact holds, in write order, from the source headers alone, with
the checks that the checkpoint holds what the config describes. Names and source layouts:
converters/gpt_oss/names.py.

Experts: the release's MXFP4 `*_blocks` (read as bf16 [E, out, in] by porter.format.prequantized, scale
bytes kept, so MXFP4 -> MXFP8 is exact) or transformers' bf16 [E, in, out] (transposed per expert); gate/up
rows and bias entries uninterleaved to [gate; up]. Every other tensor is carried under its own name.
"""

from __future__ import annotations

import re

from converters import experts
from converters.gpt_oss import names as N
from converters.gpt_oss.config import GptOssConfig
from converters.plan_common import (
    carried_tensors,
    check_options,
    plain_tensor,
    require_tensors,
    top_level_needs,
    top_level_shapes,
    top_order,
)
from porter.errors import LayoutError, PorterError
from porter.format.layout import OutTensor, layer_of

LAYOUTS = ("porter",)
DEFAULT_SCOPE = {"porter": "experts"}
# linears quantized by `--quantize all` besides the experts: attention projections (the router stays
# unquantized, as in the release's modules_to_not_convert)
_ALL_SCOPE = re.compile(r"^model\.layers\.\d+\.self_attn\.[qkvo]_proj\.weight$")


def plan_tensors(
    cfg: GptOssConfig,
    src_meta: dict,
    quantize: str = "experts",
    gate_up: str = "auto",
    layout: str = "porter",
) -> list[OutTensor]:
    """Every output tensor, in write order, from the source tensor metadata {name: (dtype, shape)}.

    quantize: "experts" (routed experts), "all" (+ attention projections), "none". gate_up: "auto" and
    "interleaved" read the sources' alternating gate/up (gpt-oss's only order); "uninterleaved" is refused.
    """
    check_options(quantize, layout, LAYOUTS, "gpt-oss")
    if gate_up == "uninterleaved":
        raise PorterError(
            "--gate-up uninterleaved: gpt-oss checkpoints always alternate gate/up rows (gate = gu[..., ::2]); "
            "use auto"
        )
    canon, carried = {}, []
    for src in src_meta:
        c = N.canonical_name(src)
        if c is None:
            carried.append(src)
        else:
            canon[c] = src
    experts, plain = {}, []
    for c in canon:
        m = N.EXPERTS.match(c)
        if m:
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = canon[c]
        else:
            plain.append(c)
    _check_layers(cfg, canon, experts)
    by_layer: dict = {}
    for c in plain:
        by_layer.setdefault(layer_of(c), []).append(c)
    out = [_plain(c, canon[c], src_meta, quantize) for c in sorted(by_layer.pop(None, []), key=top_order)]
    for layer in range(cfg.num_hidden_layers):
        out += [_plain(c, canon[c], src_meta, quantize) for c in sorted(by_layer.pop(layer, []))]
        out += _experts(cfg, layer, experts[layer], src_meta, quantize)
    if by_layer:
        extra = sorted(by_layer)
        raise LayoutError(
            f"tensors for layer(s) {extra} exceed num_hidden_layers={cfg.num_hidden_layers} "
            f"(e.g. {canon[by_layer[extra[0]][0]]!r})"
        )
    out += carried_tensors(carried, src_meta)
    _check_out(cfg, out)
    return out


def _plain(c, src, src_meta, quantize):
    return plain_tensor(c, src, src_meta, quantize, _ALL_SCOPE)


def _experts(cfg: GptOssConfig, layer: int, found: dict, src_meta: dict, quantize: str) -> list[OutTensor]:
    """w13_weight, w2_weight [E, N, K] built expert by expert, then the two biases."""
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    p = f"model.layers.{layer}.mlp.experts."
    mxfp4 = N.MXFP4_GATE_UP in found
    gu_name, dn_name = (N.MXFP4_GATE_UP, N.MXFP4_DOWN) if mxfp4 else (N.BF16_GATE_UP, N.BF16_DOWN)
    want = {  # source shapes as read
        gu_name: (e, 2 * i, h) if mxfp4 else (e, h, 2 * i),
        dn_name: (e, h, i) if mxfp4 else (e, i, h),
        N.GATE_UP_BIAS: (e, 2 * i),
        N.DOWN_BIAS: (e, h),
    }
    packed = [
        n for n in (N.MXFP4_GATE_UP, N.MXFP4_DOWN) if n in found and src_meta[found[n]][0] != N.DEQUANTIZED
    ]
    if packed:  # blocks listed as stored: the config did not say they are MXFP4
        raise LayoutError(
            f"{found[packed[0]]}: packed MXFP4 blocks, but config.json has no quantization_config with "
            "quant_method mxfp4; restore the release's config.json"
        )
    for part, shape in want.items():
        if part not in found:
            raise LayoutError(f"layer {layer}: missing {p}{part} (the experts need {', '.join(want)})")
        if tuple(src_meta[found[part]][1]) != shape:
            raise LayoutError(
                f"{found[part]}: shape {list(src_meta[found[part]][1])}, expected {list(shape)} from the config"
            )
    extra = sorted(set(found) - set(want))
    if extra:
        raise LayoutError(
            f"{p}{extra[0]}: not a gpt-oss expert tensor (with {gu_name} the experts are {', '.join(want)})"
        )
    gu, dn, gub, dnb = found[gu_name], found[dn_name], found[N.GATE_UP_BIAS], found[N.DOWN_BIAS]
    # [E, out, in] rows as read (MXFP4: scale rows follow), or [E, in, out] transposed per expert
    orient = (lambda w: w) if mxfp4 else (lambda w: w.t())
    q = quantize != "none"
    return [
        OutTensor(
            N.experts_w13_name(layer),
            (e, 2 * i, h),
            src_meta[gu][0],
            [gu],
            read_expert_rows=lambda read, x: [experts.uninterleave_gate_up(orient(read(gu, x)))],  # [2I, H]
            quantize=q,
        ),
        OutTensor(
            N.experts_w2_name(layer),
            (e, h, i),
            src_meta[dn][0],
            [dn],
            read_expert_rows=lambda read, x: [orient(read(dn, x))],  # [H, I]
            quantize=q,
        ),
        OutTensor(
            N.experts_w13_bias_name(layer),
            (e, 2 * i),
            src_meta[gub][0],
            [gub],
            lambda read: N.uninterleave_bias(read(gub)),  # [E, 2I] [gate; up]
        ),
        OutTensor(N.experts_w2_bias_name(layer), (e, h), src_meta[dnb][0], [dnb], experts.read_one(dnb)),
    ]


def _check_layers(cfg: GptOssConfig, canon: dict, experts: dict) -> None:
    """Fail before any work if the checkpoint does not hold what the config describes."""
    need = top_level_needs(cfg)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        need += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.sinks"]
        need += [p + f"self_attn.{x}.weight" for x in projections]
        if cfg.attention_bias:
            need += [p + f"self_attn.{x}.bias" for x in projections]
        need += [p + "mlp.router.weight", p + "mlp.router.bias"]
        if layer not in experts:
            raise LayoutError(
                f"layer {layer} has no expert tensors (model.layers.{layer}.mlp.experts.*); "
                "check that config.json belongs to these weights"
            )
    require_tensors(need, canon)


def _check_out(cfg: GptOssConfig, out: list) -> None:
    h, nq, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = top_level_shapes(cfg)
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nq * d, h),
        "self_attn.k_proj.weight": (nkv * d, h),
        "self_attn.v_proj.weight": (nkv * d, h),
        "self_attn.o_proj.weight": (h, nq * d),
        "self_attn.q_proj.bias": (nq * d,),
        "self_attn.k_proj.bias": (nkv * d,),
        "self_attn.v_proj.bias": (nkv * d,),
        "self_attn.o_proj.bias": (h,),
        "self_attn.sinks": (nq,),
        "mlp.router.weight": (cfg.num_local_experts, h),
        "mlp.router.bias": (cfg.num_local_experts,),
    }
    for t in out:
        layer = layer_of(t.name)
        want = shapes.get(t.name) if layer is None else per_layer.get(t.name.split(".", 3)[3])
        if want and tuple(t.shape) != want:
            raise LayoutError(f"{t.sources[0]}: shape {list(t.shape)}, expected {list(want)} from the config")
        if t.quantize and t.shape[-1] % 32:
            raise LayoutError(
                f"{t.sources[0]}: K={t.shape[-1]} is not a multiple of 32, cannot be MXFP8; "
                "use --quantize experts or none"
            )
