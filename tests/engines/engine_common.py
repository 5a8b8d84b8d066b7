"""Shared pieces of the engine harnesses (run as subprocesses in the engines venv, one per engine).

Each harness builds the engine's own MiniMax-M3 model on CPU from porter's config.json (text_config and the
top-level quantization_config), fills every parameter with a sentinel, feeds porter's `--layout hf` tensors
through the engine's own `load_weights`, and reports what it found as JSON for tests/engines/test_engines.py.
"""

from __future__ import annotations

import enum
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import torch
import transformers  # noqa: F401  (import before the torchvision stub: transformers probes torchvision)

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/: the harnesses run as scripts
from tensor_checks import load_all, same_bytes  # noqa: E402,F401  (the harnesses use both through this module)

HF_PREFIX = "language_model."
# attention KV-cache scale buffers: defaults by design, no checkpoint tensor feeds them
KV_SCALE_SUFFIXES = ("attn.k_scale", "attn.v_scale", "attn.q_scale", "attn.prob_scale")


def stub_torchvision() -> None:
    """The PyPI torchvision cannot load beside the CPU torch wheel; the engines' model modules only need
    `torchvision.transforms.InterpolationMode` (and importable submodules) at import time."""

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"
        BOX = "box"
        HAMMING = "hamming"
        NEAREST_EXACT = "nearest-exact"

    class _Any:
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return _Any()

        def __getattr__(self, k):
            return _Any()

    class _Module(types.ModuleType):
        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return InterpolationMode if k == "InterpolationMode" else _Any

    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
        "torchvision.io",
        "torchvision.ops",
        "torchvision.models",
    ]
    for name in names:
        m = _Module(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        m.__path__ = []
        sys.modules[name] = m
    for name in names[1:]:
        parent, child = name.rsplit(".", 1)
        setattr(sys.modules[parent], child, sys.modules[name])


def text_weights(tensors: dict) -> list:
    """(name without `language_model.`, tensor) for the text model, as the VL wrappers hand them on."""
    return [(n[len(HF_PREFIX) :], t) for n, t in tensors.items() if n.startswith(HF_PREFIX)]


def fill_sentinel(model) -> None:
    """NaN in float params, byte 0xFF in uint8 (E8M0 NaN; porter never writes it) and 0x7F (E4M3 NaN) in fp8."""
    for _, p in model.named_parameters():
        with torch.no_grad():
            if p.dtype == torch.uint8:
                p.data.fill_(0xFF)
            elif p.dtype == torch.float8_e4m3fn:
                p.data.view(torch.uint8).fill_(0x7F)
            elif p.dtype.is_floating_point:
                p.data.fill_(float("nan"))
            else:
                p.data.fill_(-1)


def sentinel_left(p: torch.Tensor) -> int:
    """Elements still holding the sentinel."""
    t = p.data
    if t.dtype == torch.uint8:
        return int((t == 0xFF).sum())
    if t.dtype == torch.float8_e4m3fn:
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if t.dtype.is_floating_point:
        return int(torch.isnan(t).sum())
    return int((t == -1).sum())


def is_kv_scale(name: str) -> bool:
    return name.endswith(KV_SCALE_SUFFIXES)


def engine_modules(cfg: dict, engine_names: dict) -> list:
    """(engine prefix, porter unfused module names it covers) for every quantizable text module.

    `engine_names` maps each role (qkv, index_qk, o_proj, experts, shared_gate_up, shared_down, gate, gate_up,
    down) to the engine's module name under `model.layers.{i}.`; a role named like the one before it (vLLM
    fuses the indexer's q/k into qkv_proj) joins that entry."""
    t = cfg["text_config"]
    sparse = t["sparse_attention_config"]["sparse_attention_freq"]
    out = []
    for layer in range(t["num_hidden_layers"]):
        p = f"{HF_PREFIX}model.layers.{layer}."
        a, m = p + "self_attn.", p + "block_sparse_moe."
        roles = [("qkv", [a + f"{x}_proj" for x in ("q", "k", "v")])]
        if sparse[layer]:
            roles.append(("index_qk", [a + "index_q_proj", a + "index_k_proj"]))
        roles.append(("o_proj", [a + "o_proj"]))
        if t["moe_layer_freq"][layer]:
            roles += [
                (
                    "experts",
                    [
                        m + f"experts.{e}.{w}"
                        for e in range(t["num_local_experts"])
                        for w in ("w1", "w2", "w3")
                    ],
                ),
                ("shared_gate_up", [m + "shared_experts.gate_proj", m + "shared_experts.up_proj"]),
                ("shared_down", [m + "shared_experts.down_proj"]),
                ("gate", [m + "gate"]),
            ]
        else:
            roles += [("gate_up", [p + "mlp.gate_proj", p + "mlp.up_proj"]), ("down", [p + "mlp.down_proj"])]
        layer_out = []
        for role, members in roles:
            prefix = p + engine_names[role]
            if layer_out and layer_out[-1][0] == prefix:
                layer_out[-1][1].extend(members)
            else:
                layer_out.append((prefix, members))
        out += layer_out
    out.append((HF_PREFIX + "lm_head", [HF_PREFIX + "lm_head"]))
    return out


def ignore_records(cfg: dict, engine_names: dict, excluded, excluded_all_listed, weight) -> list:
    """Per engine module: whether the engine leaves it unquantized under porter's ignore list (`excluded`) and
    under the list naming every text linear (`excluded_all_listed`), which of porter's modules it covers are
    listed, and the dtype of the weight the engine made for it (`weight(prefix)`, None when it has none)."""
    listed = set(cfg["quantization_config"]["ignored_layers"])
    out = []
    for prefix, members in engine_modules(cfg, engine_names):
        w = weight(prefix)
        out.append(
            {
                "module": prefix,
                "engine_excluded": excluded(prefix),
                "porter_listed": [m in listed for m in members],
                "engine_excluded_all_listed": excluded_all_listed(prefix),
                "engine_dtype": str(w.dtype) if w is not None else None,
            }
        )
    return out


def write_report(
    path: Path, head: dict, params: dict, sentinel: dict, tensors: dict, ignore: list, rows: tuple[int, list]
) -> None:
    """The JSON report tests/engines/test_engines.py asserts on: `head` (engine name and its own counts), then
    the fields both engines report."""
    checked, bad_rows = rows
    report = {
        **head,
        "kv_scale_params": sorted(n for n in params if is_kv_scale(n)),
        "sentinel_left": {n: c for n, c in sentinel.items() if c},
        "ignore": ignore,
        "rows_checked": checked,
        "rows_mismatched": bad_rows,
        "fed_tensors": sum(1 for n in tensors if n.startswith(HF_PREFIX)),
    }
    path.write_text(json.dumps(report, indent=1))
