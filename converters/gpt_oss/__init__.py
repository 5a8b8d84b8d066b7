"""The gpt-oss converter (gpt-oss-20b, gpt-oss-120b): config resolution, tensor names, the output plan, and
verify's own source table (the verify_rules capability). No hf layout: no serving engine runs an MXFP8
gpt-oss with expert biases today (docs/gpt-oss.md).

Sources: OpenAI's release (`quant_method: mxfp4`: MXFP4 experts, read exactly through
porter.format.prequantized / porter.format.mxfp4) and transformers' bf16 layout. Output: porter's canonical
layout (converters/gpt_oss/names.py). Facts and provenance: docs/gpt-oss.md. Callers reach it through the
registry: `converters.for_config(raw_config)`.
"""

from converters.gpt_oss import verify_rules
from converters.gpt_oss.config import (
    ARCHITECTURE,
    FULL_ATTN,
    MODEL_TYPES,
    SLIDING_ATTN,
    GptOssConfig,
    config_sizes,
    manifest_facts,
    resolve_config,
    source_layout,
)
from converters.gpt_oss.names import canonical_name
from converters.gpt_oss.plan import DEFAULT_SCOPE, LAYOUTS, plan_tensors
from converters.gpt_oss.sizes import SIZE_RULES

hf_layout = None  # no engine runs an MXFP8 gpt-oss with expert biases (docs/gpt-oss.md)

__all__ = [
    "ARCHITECTURE",
    "MODEL_TYPES",
    "LAYOUTS",
    "DEFAULT_SCOPE",
    "hf_layout",
    "verify_rules",
    "SIZE_RULES",
    "SLIDING_ATTN",
    "FULL_ATTN",
    "GptOssConfig",
    "resolve_config",
    "config_sizes",
    "manifest_facts",
    "source_layout",
    "plan_tensors",
    "canonical_name",
]
