"""Tampering helpers for the `porter verify` tests: rewrite one tensor of an artifact in place, and
optionally re-seal porter.json (the tensor's and the shard's digests) so that integrity passes and only
the numerics (the comparison with the reference) can catch the change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from tensor_checks import shard_digests

from porter.format.safetensors_io import ST_DTYPES
from porter.source.local import read_header, tensor_span


def copy_artifact(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _locate(art: Path, name: str):
    art = Path(art)
    man = json.loads((art / "porter.json").read_text())
    shard = art / man["tensors"][name]["shard"]
    info = read_header(shard)[name]
    offset, length = tensor_span(shard, info)
    return man, shard, offset, length, ST_DTYPES[info["dtype"]], tuple(info["shape"])


def read_tensor(art: Path, name: str) -> torch.Tensor:
    _, shard, off, n, dtype, shape = _locate(art, name)
    with open(shard, "rb") as f:
        f.seek(off)
        raw = bytearray(f.read(n))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def rewrite_tensor(
    art: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor], reseal: bool = True
) -> None:
    """Replace tensor `name` by fn(tensor) (same dtype and shape), bytes overwritten in place in its shard.
    reseal=True also updates porter.json (tensor and shard digests) so integrity still passes."""
    art = Path(art)
    man, shard, off, n, dtype, shape = _locate(art, name)
    new = fn(read_tensor(art, name)).contiguous()
    assert new.dtype == dtype and tuple(new.shape) == shape, (new.dtype, new.shape)
    data = new.view(torch.uint8).reshape(-1).numpy().tobytes()
    assert len(data) == n
    with open(shard, "r+b") as f:
        f.seek(off)
        f.write(data)
    if reseal:
        reseal_shard(man, shard)
        (art / "porter.json").write_text(json.dumps(man, indent=1))


def reseal_shard(man: dict, shard: Path) -> None:
    """Record a changed shard's digests (header, every tensor, the shard) in porter.json's dict `man`."""
    head, tensors, digest = shard_digests(shard, man["digest"]["chunk_bytes"])
    man["shards"][shard.name].update(header_sha256=head, digest=digest)
    for n, d in tensors.items():
        man["tensors"][n]["digest"] = d


def flip_byte(art: Path, name: str, index: int = 0) -> None:
    """Flip one bit of one data byte of `name` without touching porter.json (a checksum mismatch)."""
    _, shard, off, n, _, _ = _locate(art, name)
    with open(shard, "r+b") as f:
        f.seek(off + index)
        b = f.read(1)[0]
        f.seek(off + index)
        f.write(bytes([b ^ 0x01]))


def edit_config(art: Path, **text_fields) -> None:
    """Change text-config fields of the artifact's config.json (vendor layout: under text_config)."""
    p = Path(art) / "config.json"
    cfg = json.loads(p.read_text())
    (cfg.get("text_config", cfg)).update(text_fields)
    p.write_text(json.dumps(cfg, indent=2))


def shift_scales(delta: int, expert=None):
    def fn(s):
        s = s.clone()
        sel = s if expert is None else s[expert]
        nz = sel != 0
        sel[nz] = (sel[nz].to(torch.int32) + delta).clamp(1, 254).to(torch.uint8)
        return s

    return fn


def nudge_e4m3(*index):
    """One e4m3 value at `index` moved by one ulp (its lowest mantissa bit flipped; the next bit where that
    would make the NaN pattern)."""

    def fn(q):
        q = q.clone()
        raw = q.view(torch.uint8)
        b = int(raw[index])
        raw[index] = b ^ 0x01 if (b ^ 0x01) & 0x7F != 0x7F else b ^ 0x02
        return q

    return fn


def zero_scales(expert: int):
    def fn(s):
        s = s.clone()
        s[expert] = 0
        return s

    return fn


def swap_gate_up(expert: int):
    """w13 [E, 2I, H] ([gate; up]) -> the expert's halves swapped (values and, separately, scales)."""

    def fn(t):
        t = t.clone()
        i = t.shape[1] // 2
        t[expert] = torch.cat([t[expert, i:], t[expert, :i]])
        return t

    return fn


# ---------------------------------------------------------------------------------------------------
# The converted model as verify loads it: a float-rounding stand-in for a GPU kernel, and planted
# runtime bugs (the bytes and the config are right; what the runtime computes with them is not)


def moe_layers(model) -> dict:
    """{layer index: its runtime MoE block} of a loaded model (resident layers)."""
    return {i: layer.mlp for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "experts")}


class Fp32InsideMoE:
    """A MoE backend computing what the torch backend computes with fp32 operands and accumulation inside,
    the output rounded to the model's dtype once — as porter's Triton kernel keeps GEMM1 and SwiGLU in fp32
    (runtime/moe/triton/kernels.py). Against the torch backend in bfloat16 it differs by float rounding
    alone: a CPU stand-in for the rounding-order difference of a GPU kernel."""

    def __init__(self, inner):
        self.inner, self.quant, self.routing = inner, inner.quant, inner.routing

    def forward_topk(self, hidden, topk_ids, topk_weights):
        return self.inner.forward_topk(hidden.float(), topk_ids, topk_weights).to(hidden.dtype)

    def __call__(self, hidden):
        from runtime.moe.contract import route

        return self.forward_topk(hidden, *route(hidden, self.inner.routing))


def fp32_inside(model) -> None:
    for moe in moe_layers(model).values():
        moe.experts = Fp32InsideMoE(moe.experts)


def runtime_bug(kind: str, layer: int, expert: int = 1):
    """A model hook planting one runtime bug in MoE layer `layer`: "alpha" (SwiGLU alpha 1.0 instead of the
    config's), "rsf" (routed_scaling_factor 1.0), "gate_up" (one expert's gate and up rows swapped),
    "scale" (one expert's w2 scale bytes + 1: that expert's down projection doubled)."""
    import dataclasses

    def hook(model):
        experts = moe_layers(model)[layer].experts
        backend = getattr(experts, "inner", experts)
        q = backend.quant
        if kind == "alpha":
            q = dataclasses.replace(q, gemm1_alpha=torch.full_like(q.gemm1_alpha, 1.0))
        elif kind == "gate_up":
            w, s = swap_gate_up(expert)(q.w13_weight), swap_gate_up(expert)(q.w13_weight_scale)
            q = dataclasses.replace(q, w13_weight=w, w13_weight_scale=s)
        elif kind == "scale":
            q = dataclasses.replace(q, w2_weight_scale=shift_scales(+1, expert)(q.w2_weight_scale))
        elif kind == "rsf":
            backend.routing = dataclasses.replace(backend.routing, routed_scaling_factor=1.0)
        else:
            raise ValueError(kind)
        backend.quant = q

    return hook


def patch_converted(monkeypatch, art: Path, *hooks) -> None:
    """runtime.load of the artifact `art` (the converted model, as verify loads it) applies `hooks` to the
    model; every other load (the references) is left alone."""
    import runtime

    load = runtime.load

    def patched(path, *a, **k):
        model = load(path, *a, **k)
        if isinstance(path, (str, Path)) and Path(path).resolve() == Path(art).resolve():
            for hook in hooks:
                hook(model)
        return model

    monkeypatch.setattr(runtime, "load", patched)
