"""The MiniMax-M2 hf layout: the release's own names, which vLLM and sglang load (docs/serving-engines.md).
model.layers.{l}.block_sparse_moe.experts.{e}.w1/w2/w3.weight   F8_E4M3 [N, K], never stacked
<module>.weight (F8_E4M3 [N, K]) + <module>.weight_scale_inv (U8 [N, K/32]) for every quantized linear
config.json: the source's, its FP8 quantization_config replaced by porter's mxfp8 one (top level)
"""

from __future__ import annotations

import json
import re
from typing import Optional

from converters import experts
from converters.block_sparse_moe_names import EXPERTS
from converters.hf_common import mxfp8_quantization_config
from converters.minimax_m2.config import MODEL_TYPES
from porter.errors import ConfigError

# --quantize default per layout: the hf layout takes the vendor release's scope (attention + experts)
DEFAULT_SCOPE = {"porter": "experts", "hf": "all"}
HF_ARCHITECTURES = ["MiniMaxM2ForCausalLM"]
_TEXT_LINEAR = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|block_sparse_moe\.(gate|experts\.\d+\.w[123]))\.weight$"
    r"|^lm_head\.weight$"
)


def hf_ignored_layers(out: list) -> list:
    """Module paths of the text-model linears left unquantized, `lm_head` always included (vLLM quantizes
    lm_head unless it is listed); the engines match these against their module prefixes."""
    names = [t.name[: -len(".weight")] for t in out if not t.quantize and _TEXT_LINEAR.match(t.name)]
    return names if "lm_head" in names else names + ["lm_head"]


def hf_quantization_config(out: list, quantize: str, scale_rounding: str) -> Optional[dict]:
    """The top-level config.json `quantization_config` of an hf-layout artifact (None when nothing is
    quantized); one list under both ignore keys (vLLM reads `ignored_layers`, sglang
    `modules_to_not_convert`)."""
    return mxfp8_quantization_config(hf_ignored_layers(out), quantize, scale_rounding)


def check_hf_source(raw: dict, where: str = "config.json") -> None:
    """Any MiniMax-M2 source can be written in the hf layout (its names are the release's)."""
    if raw.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"{where}: --layout hf for MiniMax-M2 needs model_type minimax_m2")


def hf_config_json(raw: dict, qconfig: Optional[dict]) -> dict:
    """The source's config.json with the release's architectures and porter's quantization_config in place
    of the source's own (a pre-quantized FP8 release's)."""
    check_hf_source(raw)
    cfg = json.loads(json.dumps(raw))
    cfg["architectures"] = list(HF_ARCHITECTURES)
    cfg.pop("quantization_config", None)
    if qconfig is not None:
        cfg["quantization_config"] = qconfig
    return cfg


def hf_canonical_map(names) -> dict:
    """hf-layout tensor names -> the canonical view the runtime reads (converters.experts.hf_canonical_map):
    the same names, per-expert weights stacked when touched."""
    return experts.hf_canonical_map(names, EXPERTS)
