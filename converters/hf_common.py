"""What every family's hf layout writes alike: the top-level config.json `quantization_config` of an MXFP8
artifact, which vLLM and sglang read (docs/serving-engines.md). The family says which linears stay
unquantized (its `hf_ignored_layers`)."""

from __future__ import annotations

from typing import Optional

from porter.format import mxfp8


def mxfp8_quantization_config(ignored: list, quantize: str, scale_rounding: str) -> Optional[dict]:
    """None when nothing is quantized (the artifact is then a plain bf16 checkpoint). One list under both
    ignore keys (vLLM reads `ignored_layers`, sglang the first of the two present); no `moe_quant_*` keys
    (they switch sglang to NVFP4)."""
    if quantize == "none":
        return None
    return {
        "quant_method": "mxfp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, mxfp8.BLOCK],
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "ignored_layers": ignored,
        "modules_to_not_convert": list(ignored),
        "porter": {"layout": "hf", "scope": quantize, "scale_rounding": scale_rounding},
    }
