"""Shared pieces of the MiniMax-M2 engine harnesses (vllm_m2_harness.py, sglang_m2_harness.py).

Porter's M2 `--layout hf` artifact uses the release's own names (no `language_model.` prefix): per layer
`self_attn.{q,k,v,o}_proj`, `block_sparse_moe.experts.{e}.w{1,2,3}`, `block_sparse_moe.gate`, MXFP8 scales
as `X.weight_scale_inv`, and the MTP layers after the decoder layers (`model.layers.{L + i}.…`), which both
engines' M2 classes skip (docs/serving-engines.md#minimax-m2).

Every engine parameter is compared with the tensor it must equal, built from porter's tensors in the
engine's fused order: `qkv_proj = [q; k; v]`, `w13[e] = [w1_e; w3_e]`, `w2[e] = w2_e`, everything else by name.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import engine_common as common
import torch

QKV = ("q", "k", "v")


def read(art: Path) -> tuple[dict, dict]:
    """config.json and every tensor of the artifact, in the artifact's order (files sorted, keys as stored),
    the order the engines' safetensors iterators hand them on."""
    return json.loads((art / "config.json").read_text()), common.load_all(art)


def mtp_names(cfg: dict, tensors: dict) -> list:
    """Porter's tensors of the MTP layers (`model.layers.{num_hidden_layers + i}.…`)."""
    first = cfg["num_hidden_layers"]
    layers = {f"model.layers.{first + i}." for i in range(cfg.get("num_mtp_modules", 0))}
    return sorted(n for n in tensors if n.startswith(tuple(layers)))


def expected(name: str, tensors: dict) -> tuple[torch.Tensor, list]:
    """(what engine parameter `name` must hold, porter's tensor names it is made of). vLLM names the scales
    `weight_scale` (sglang `weight_scale_inv`, as porter) and nests its experts under `routed_experts`."""
    n = name.replace(".experts.routed_experts.", ".experts.")
    n = n + "_inv" if n.endswith("weight_scale") else n
    m = re.match(r"(.*\.experts)\.w(13|2)_(weight(?:_scale_inv)?)$", n)
    if m:
        base, which, attr = m.groups()
        experts = sorted({int(k[len(base) + 1 :].split(".")[0]) for k in tensors if k.startswith(base + ".")})
        parts = [
            [f"{base}.{e}.w{w}.{attr}" for w in (("1", "3") if which == "13" else ("2",))] for e in experts
        ]
        return torch.stack([torch.cat([tensors[p] for p in ps]) for ps in parts]), sum(parts, [])
    if ".qkv_proj." in n:
        parts = [n.replace(".qkv_proj.", f".{x}_proj.") for x in QKV]
        return torch.cat([tensors[p] for p in parts]), parts
    return tensors[n], [n]


def same_or_widened(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Byte-equal; or, where the engine keeps a float parameter wider than porter's (the fp32 router gate
    over a bf16 tensor), equal after that exact widening."""
    if got.dtype == want.dtype:
        return common.same_bytes(got, want)
    exact = want.dtype.is_floating_point and got.dtype.itemsize > want.dtype.itemsize
    return exact and got.shape == want.shape and common.same_bytes(got, want.to(got.dtype))


def param_checks(params: dict, tensors: dict) -> tuple[list, list, set]:
    """Each non-KV-scale parameter against porter's bytes: (checked names, mismatched names, porter tensor
    names used)."""
    checked, bad, used = [], [], set()
    for name, p in params.items():
        if common.is_kv_scale(name):
            continue
        want, parts = expected(name, tensors)
        used |= set(parts)
        checked.append(name)
        if not same_or_widened(p.data, want):
            bad.append(name)
    return checked, bad, used


def modules(cfg: dict, engine_names: dict) -> list:
    """(engine module, porter's unfused modules it covers) for every linear of the text model."""
    out = []
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a, m = p + "self_attn.", p + "block_sparse_moe."
        experts = [m + f"experts.{e}.w{w}" for e in range(cfg["num_local_experts"]) for w in (1, 2, 3)]
        roles = {
            "qkv": [a + f"{x}_proj" for x in QKV],
            "o_proj": [a + "o_proj"],
            "experts": experts,
            "gate": [m + "gate"],
        }
        out += [(p + engine_names[role], members) for role, members in roles.items()]
    return out + [("lm_head", ["lm_head"])]


def module_dtypes(cfg: dict, engine_names: dict, params: dict) -> list:
    """Per engine module: which of porter's modules it covers are in porter's ignore list, and the dtype of
    the weight the engine built (fp8 exactly where porter quantized is what serving needs)."""
    listed = set(cfg["quantization_config"]["ignored_layers"])
    out = []
    for module, members in modules(cfg, engine_names):
        w = params.get(module + (".w13_weight" if module.endswith("experts") else ".weight"))
        out.append(
            {
                "module": module,
                "porter_listed": [m in listed for m in members],
                "engine_dtype": str(w.dtype) if w is not None else None,
            }
        )
    return out


def write_report(
    path: Path, head: dict, cfg: dict, params: dict, fed: dict, reference: dict, engine_names: dict
) -> None:
    """The JSON report tests/engines/test_engines_m2.py asserts on: what was `fed`, and every parameter
    against porter's tensors `reference` (the same artifact unless a test fed a tampered copy), compared only
    when the load finished (`head["error"]` is None)."""
    sentinel = {n: common.sentinel_left(p) for n, p in params.items() if not common.is_kv_scale(n)}
    checked, bad, used = param_checks(params, reference) if head["error"] is None else ([], [], set())
    report = {
        **head,
        "params": len(params),
        "kv_scale_params": sorted(n for n in params if common.is_kv_scale(n)),
        "sentinel_left": {n: c for n, c in sentinel.items() if c},
        "written": sorted(n for n, c in sentinel.items() if c == 0),
        "checked": checked,
        "mismatched": bad,
        "unused": sorted(set(reference) - used) if checked else None,
        "fed": list(fed),
        "mtp": mtp_names(cfg, fed),
        "module_dtypes": module_dtypes(cfg, engine_names, params),
    }
    path.write_text(json.dumps(report, indent=1))


def arguments(doc: str, *flags: str):
    """ARTIFACT_DIR REPORT.json [--reference DIR] and the harness's own flags."""
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("report", type=Path)
    ap.add_argument("--reference", type=Path, help="porter's artifact to compare with (default: the one fed)")
    for f in flags:
        ap.add_argument(f, action="store_true")
    return ap.parse_args()
