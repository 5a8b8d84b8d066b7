"""The gpt-oss converter (gpt-oss-20b, gpt-oss-120b): config resolution, tensor names, the output plan.

Sources: OpenAI's release (`quant_method: mxfp4`: MXFP4 experts, read exactly through
porter.format.prequantized / porter.format.mxfp4) and transformers' bf16 layout. Output: porter's canonical
layout (converters/gpt_oss/names.py). Facts and provenance: docs/gpt-oss.md. Callers reach it through the
registry: `converters.for_config(raw_config)`.
"""

from converters.gpt_oss import names as _names
from converters.gpt_oss import verify_rules
from converters.gpt_oss.config import (
    ARCHITECTURE,
    FULL_ATTN,
    MODEL_TYPES,
    SLIDING_ATTN,
    GptOssConfig,
    manifest_facts,
    resolve_config,
)
from converters.gpt_oss.hf_layout import (
    HF_ARCHITECTURES,
    check_hf_source,
    hf_canonical_map,
    hf_config_json,
    hf_ignored_layers,
    hf_name,
    hf_quantization_config,
)
from converters.gpt_oss.names import canonical_name, experts_w2_name, experts_w13_name
from converters.gpt_oss.plan import DEFAULT_SCOPE, LAYOUTS, plan_tensors


def interleave_gate_up(w):
    return _names.interleave_gate_up(w)


def uninterleave_gate_up(w):
    return _names.uninterleave_gate_up(w)


__all__ = [
    "ARCHITECTURE",
    "MODEL_TYPES",
    "LAYOUTS",
    "DEFAULT_SCOPE",
    "HF_ARCHITECTURES",
    "verify_rules",
    "SLIDING_ATTN",
    "FULL_ATTN",
    "GptOssConfig",
    "resolve_config",
    "manifest_facts",
    "plan_tensors",
    "canonical_name",
    "experts_w13_name",
    "experts_w2_name",
    "interleave_gate_up",
    "uninterleave_gate_up",
    "check_hf_source",
    "hf_config_json",
    "hf_quantization_config",
    "hf_ignored_layers",
    "hf_name",
    "hf_canonical_map",
]
