"""The hf layout: the vendor release's names, which vLLM and sglang load (docs/serving-engines.md).
language_model.model.layers.{l}.block_sparse_moe.experts.{e}.w1/w2/w3.weight   F8_E4M3 [N, K], never stacked
<module>.weight (F8_E4M3 [N, K]) + <module>.weight_scale_inv (U8 [N, K/32]) for every quantized linear
config.json: the vendor `architectures`; `quantization_config` at the top level (sglang reads only there)
"""

from __future__ import annotations

import json
import re
from typing import Optional

from converters import experts
from converters.block_sparse_moe_names import EXPERTS, expert_name
from converters.hf_common import mxfp8_quantization_config
from converters.minimax_m3.config import TextConfig, resolve_config
from porter.errors import ConfigError, LayoutError

HF_PREFIX = "language_model."  # the hf layout's text-model names: this prefix + the canonical name

LAYOUTS = ("porter", "hf")
# --quantize default per layout: the hf layout's groups (shared + routed experts) must share one format,
# so it defaults to the vendor MXFP8 release's scope.
DEFAULT_SCOPE = {"porter": "experts", "hf": "all"}
HF_ARCHITECTURES = ["MiniMaxM3SparseForConditionalGeneration"]
_TEXT_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o|index_q|index_k)_proj|mlp\.(gate|up|down)_proj"
    r"|block_sparse_moe\.(gate|shared_experts\.(gate|up|down)_proj|experts\.\d+\.w[123]))\.weight$"
    r"|^lm_head\.weight$"
)


def hf_name(canonical: str) -> str:
    """Canonical text-model name -> hf layout name (the vendor `language_model.` prefix)."""
    return HF_PREFIX + canonical


def to_hf_layout(cfg: TextConfig, out: list, quantize: str) -> list:
    """Rename a canonical plan (experts already per-expert) to hf names, after checking format groups."""
    _check_format_groups(cfg, out, quantize)
    for t in out:
        if not t.carried:
            t.name, t.layout = hf_name(t.name), "hf"
    return out


def _format_groups(cfg: TextConfig, layer: int) -> list:
    """(label, canonical weight names, why they must share one format) for one decoder layer."""
    p = f"model.layers.{layer}."
    attn = ["q", "k", "v"] + (["index_q", "index_k"] if cfg.is_sparse_attention(layer) else [])
    groups = [
        (
            "/".join(attn) + " projections",
            [p + f"self_attn.{x}_proj.weight" for x in attn],
            "vLLM loads them into one fused qkv_proj parameter whose format q/k/v decide",
        )
    ]
    if cfg.is_moe(layer):
        shared = [p + f"block_sparse_moe.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
        groups.append(
            (
                "the shared expert and the routed experts",
                shared + [expert_name(layer, 0, "w1")],
                "sglang fuses the shared expert into the routed experts",
            )
        )
    else:
        groups.append(
            (
                "gate/up projections",
                [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                "both engines load them into one fused gate_up_proj parameter",
            )
        )
    return groups


def _check_format_groups(cfg: TextConfig, out: list, quantize: str) -> None:
    quantized = {t.name: t.quantize for t in out}
    for layer in range(cfg.num_hidden_layers):
        for label, names, why in _format_groups(cfg, layer):
            if len({quantized[n] for n in names if n in quantized}) > 1:
                raise LayoutError(
                    f"--layout hf with --quantize {quantize} would give {label} of layer {layer} "
                    f"different formats, but {why}; use --quantize all (the vendor release's "
                    "scope) or none"
                )


def hf_ignored_layers(out: list) -> list:
    """Unfused full module paths of the text-model linears left unquantized, `lm_head` always included
    (vLLM quantizes lm_head unless it is listed). The engines match these against their module prefixes."""
    names = [
        t.name[: -len(".weight")]
        for t in out
        if not t.quantize and _TEXT_LINEAR.match(t.name.removeprefix(HF_PREFIX))
    ]
    lm_head = hf_name("lm_head")
    return names if lm_head in names else names + [lm_head]


def hf_quantization_config(out: list, quantize: str, scale_rounding: str) -> Optional[dict]:
    """The top-level config.json `quantization_config` of an hf-layout artifact (converters/hf_common.py),
    None when nothing is quantized."""
    return mxfp8_quantization_config(hf_ignored_layers(out), quantize, scale_rounding)


def check_hf_source(raw: dict, where: str = "config.json") -> None:
    """--layout hf needs the vendor config (VL wrapper with text_config) to write the vendor layout."""
    if raw.get("model_type") != "minimax_m3_vl" or not isinstance(raw.get("text_config"), dict):
        raise ConfigError(
            f"{where}: --layout hf writes the vendor release's layout (model_type minimax_m3_vl "
            f"with text_config), but this source is {raw.get('model_type')!r}; convert the vendor "
            "checkpoint, or use --layout porter"
        )


def hf_config_json(raw: dict, qconfig: Optional[dict]) -> dict:
    """The source's config.json as the hf layout's: vendor architectures, the source's own quantization
    (if it was pre-quantized) replaced by what porter wrote, at the top level only."""
    check_hf_source(raw)
    resolved = resolve_config(raw)
    cfg = json.loads(json.dumps(raw))
    cfg["architectures"] = list(HF_ARCHITECTURES)
    # vLLM reads text_config.swiglu_beta (and alpha, limit) without a default: write the resolved values
    for key in ("swiglu_alpha", "swiglu_beta", "swiglu_limit"):
        cfg["text_config"].setdefault(key, getattr(resolved, key))
    cfg.pop("quantization_config", None)
    cfg["text_config"].pop("quantization_config", None)
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    return cfg


def hf_canonical_map(names) -> dict:
    """hf-layout tensor names -> the canonical view the runtime reads (converters.experts.hf_canonical_map):
    the text model's names under the `language_model.` prefix, experts stacked when touched."""
    return experts.hf_canonical_map(names, EXPERTS, HF_PREFIX)
