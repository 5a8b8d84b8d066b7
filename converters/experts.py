"""Routed-expert planning shared by the converters: one rule each for stacking per-expert source weights,
slicing a fused [E, 2I, H] source, splitting experts for the hf layout, and reading the hf layout back.

Architecture-free: a converter hands in its expert names (`ExpertNames`) and its dims. Stacked experts are
porter's canonical form, `w13 [E, 2I, H]` (rows [gate; up]) and `w2 [E, H, I]`, built one expert at a time
from row parts (no concat copy), so the conversion holds one expert, never a layer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from porter.errors import LayoutError
from porter.format.layout import OutTensor


@dataclass(frozen=True)
class ExpertNames:
    """A family's canonical expert names: stacked w13 / w2 of a layer, one expert's 2-D weight (w1 gate,
    w3 up, w2 down), and the regex matching the latter (groups: layer, expert, w1|w2|w3)."""

    w13: Callable[[int], str]
    w2: Callable[[int], str]
    expert: Callable[[int, int, str], str]
    per_expert: re.Pattern


def read_one(src: str) -> Callable:
    return lambda read: read(src)


def uninterleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[..., 2I, H] rows gate0, up0, gate1, up1, ... (interleaved) -> [gate; up]."""
    return torch.cat([w[..., 0::2, :], w[..., 1::2, :]], dim=-2)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[..., 2I, H] [gate; up] -> rows gate0, up0, gate1, up1, ... (inverse of uninterleave_gate_up)."""
    i = w.shape[-2] // 2
    return torch.stack([w[..., :i, :], w[..., i:, :]], dim=-2).reshape(w.shape)


def check_vendor_experts(layer: int, found: dict, src_meta: dict, e_count: int, h: int, i: int) -> None:
    """found {(e, "w1"|"w2"|"w3"): source name}: every expert's three weights, shaped [I, H] / [H, I]."""
    missing = [f"experts.{e}.{w}" for e in range(e_count) for w in ("w1", "w2", "w3") if (e, w) not in found]
    extra = [f"experts.{e}.{w}" for (e, w) in found if e >= e_count]
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise LayoutError(f"layer {layer}: expert tensors {what} (config num_local_experts={e_count})")
    for (_, w), src in found.items():
        want = (h, i) if w == "w2" else (i, h)
        if tuple(src_meta[src][1]) != want:
            raise LayoutError(f"{src}: shape {tuple(src_meta[src][1])}, expected {want} from the config")


def stack_vendor_experts(
    names: ExpertNames, layer: int, found: dict, src_meta: dict, dims: tuple, quantize: bool
) -> list[OutTensor]:
    """Per-expert w1 (gate), w3 (up), w2 (down) -> stacked w13 [E, 2I, H] = [w1; w3] and w2 [E, H, I].
    dims: (E, H, I)."""
    e_count, h, i = dims
    check_vendor_experts(layer, found, src_meta, e_count, h, i)
    dtype = src_meta[found[(0, "w1")]][0]
    w13 = OutTensor(
        names.w13(layer),
        (e_count, 2 * i, h),
        dtype,
        [found[(e, w)] for e in range(e_count) for w in ("w1", "w3")],
        read_expert_rows=lambda read, e: [read(found[(e, "w1")]), read(found[(e, "w3")])],
        quantize=quantize,
    )
    w2 = OutTensor(
        names.w2(layer),
        (e_count, h, i),
        dtype,
        [found[(e, "w2")] for e in range(e_count)],
        read_expert_rows=lambda read, e: [read(found[(e, "w2")])],
        quantize=quantize,
    )
    return [w13, w2]


def split_vendor_experts(
    names: ExpertNames, layer: int, found: dict, src_meta: dict, dims: tuple, quantize: bool
) -> list[OutTensor]:
    """hf layout: each expert's w1, w2, w3 as its own 2-D tensor, never stacked."""
    check_vendor_experts(layer, found, src_meta, *dims)
    out = []
    for e in range(dims[0]):
        for w in ("w1", "w2", "w3"):
            src = found[(e, w)]
            dtype, shape = src_meta[src]
            out.append(
                OutTensor(
                    names.expert(layer, e, w), tuple(shape), dtype, [src], read_one(src), quantize=quantize
                )
            )
    return out


def check_fused_experts(layer: int, found: dict, src_meta: dict, dims: tuple, where: str) -> dict:
    """found {"gate_up_proj" | "down_proj": source name} shaped [E, 2I, H] / [E, H, I]; where: the source
    prefix named when one is missing (e.g. "mlp.experts")."""
    e_count, h, i = dims
    want = {"gate_up_proj": (e_count, 2 * i, h), "down_proj": (e_count, h, i)}
    for part, shape in want.items():
        if part not in found:
            raise LayoutError(f"layer {layer}: missing {where}.{part}")
        if tuple(src_meta[found[part]][1]) != shape:
            raise LayoutError(
                f"{found[part]}: shape {tuple(src_meta[found[part]][1])}, expected {shape} from the config"
            )
    return want


def slice_fused_experts(
    names: ExpertNames,
    layer: int,
    found: dict,
    src_meta: dict,
    dims: tuple,
    quantize: bool,
    interleaved: bool,
    where: str = "mlp.experts",
) -> list[OutTensor]:
    """Fused gate_up_proj [E, 2I, H] ([gate; up], or interleaved rows) / down_proj [E, H, I] -> stacked
    w13 / w2, read one expert's slice at a time (read(name, e))."""
    want = check_fused_experts(layer, found, src_meta, dims, where)
    gu, dn = found["gate_up_proj"], found["down_proj"]
    fix = uninterleave_gate_up if interleaved else (lambda w: w)
    w13 = OutTensor(
        names.w13(layer),
        want["gate_up_proj"],
        src_meta[gu][0],
        [gu],
        read_expert_rows=lambda read, e: [fix(read(gu, e))],
        quantize=quantize,
    )
    w2 = OutTensor(
        names.w2(layer),
        want["down_proj"],
        src_meta[dn][0],
        [dn],
        read_expert_rows=lambda read, e: [read(dn, e)],
        quantize=quantize,
    )
    return [w13, w2]


def split_fused_experts(
    names: ExpertNames,
    layer: int,
    found: dict,
    src_meta: dict,
    dims: tuple,
    quantize: bool,
    interleaved: bool,
    where: str = "mlp.experts",
) -> list[OutTensor]:
    """hf layout from a fused source: expert e's w1 / w3 are the gate / up rows of gate_up_proj[e], w2 is
    down_proj[e] (each read alone)."""
    check_fused_experts(layer, found, src_meta, dims, where)
    gu, dn = found["gate_up_proj"], found["down_proj"]
    e_count, h, i = dims
    fix = uninterleave_gate_up if interleaved else (lambda w: w)
    out = []
    for e in range(e_count):
        for w, shape, src, rows in (
            ("w1", (i, h), gu, slice(0, i)),
            ("w2", (h, i), dn, None),
            ("w3", (i, h), gu, slice(i, 2 * i)),
        ):
            dtype = src_meta[src][0]
            read = (
                (lambda r, s=src, e=e: r(s, e))
                if rows is None
                else (lambda r, s=src, e=e, rows=rows: fix(r(s, e))[rows])
            )
            out.append(OutTensor(names.expert(layer, e, w), shape, dtype, [src], read, quantize=quantize))
    return out


def hf_canonical_map(names, expert_names: ExpertNames, prefix: str = "") -> dict:
    """hf-layout tensor names -> the canonical view the runtime reads: {canonical: hf name} for plain
    tensors and scales (`weight_scale_inv` -> `weight_scale`), {canonical: [[hf row parts] per expert]}
    for the stacked experts (w13 = [w1; w3], w2), built by the loader when touched. Names outside `prefix`
    (a vision tower, ...) are left out."""
    out, experts = {}, {}
    for n in names:
        if not n.startswith(prefix):
            continue
        c = n[len(prefix) :]
        is_scale = c.endswith(".weight_scale_inv")
        weight = c[: -len("_scale_inv")] if is_scale else c
        if m := expert_names.per_expert.match(weight):
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            experts.setdefault((layer, is_scale), {})[(e, w)] = n
            continue
        out[c[: -len("_inv")] if is_scale else c] = n
    for (layer, is_scale), found in experts.items():
        count = 1 + max(e for e, _ in found)
        suffix = "_scale" if is_scale else ""
        for stacked, parts in ((expert_names.w13(layer), ("w1", "w3")), (expert_names.w2(layer), ("w2",))):
            missing = [f"{e}.{w}" for e in range(count) for w in parts if (e, w) not in found]
            if missing:
                raise LayoutError(
                    f"hf-layout artifact lacks expert tensor experts.{missing[0]} of layer {layer}"
                )
            out[stacked + suffix] = [[found[(e, w)] for w in parts] for e in range(count)]
    return out
