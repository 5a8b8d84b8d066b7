"""`porter verify`'s own gpt-oss source table: where each artifact tensor comes from, per source layout.

Written independently of this converter's plan (plan.py, names.py: nothing of this package is imported),
so that a layout bug there (gate/up left interleaved, down_proj not transposed, a bias not reordered) is not
on both sides of verify's comparison. Rule templates and ops: porter/commands/verify/mapping.py. {m} the
model root (`model.`), {h} the lm_head root.

Sources: the MXFP4 release, whose `*_blocks` are read dequantized ([E, out, in], porter.format.prequantized;
the scale bytes the conversion kept follow their rows), and transformers' bf16 layout ([E, in, out]). In both,
gate/up alternate along 2I (rows of the release's blocks, columns of transformers' gate_up_proj, entries
of gate_up_proj_bias).
"""

from __future__ import annotations

import re
from typing import Optional

from converters.base import Rule

_L = r"model\.layers\.(?P<L>\d+)\."
_X = _L + r"mlp\.experts\."
_SRC = "{m}layers.{L}.mlp.experts."
_STACKED = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(w13|w2)_weight")
_TOP = (Rule(r"lm_head\.(?P<rest>.+)", ("{h}{rest}",)), Rule(r"model\.(?P<rest>.+)", ("{m}{rest}",)))
_BIASES = (
    Rule(_X + r"w13_bias", (_SRC + "gate_up_proj_bias",), "columns_interleaved"),
    Rule(_X + r"w2_bias", (_SRC + "down_proj_bias",)),
)

# OpenAI's release: MXFP4 blocks [E, out, in] with gate/up rows alternating
RELEASE = (
    Rule(_X + r"w13_weight", (_SRC + "gate_up_proj_blocks",), "expert_slice_interleaved"),
    Rule(_X + r"w2_weight", (_SRC + "down_proj_blocks",), "expert_slice"),
    *_BIASES,
    *_TOP,
)
# transformers 5.23: bf16 gate_up_proj [E, H, 2I] (gate/up columns alternating), down_proj [E, I, H]
TRANSFORMERS = (
    Rule(_X + r"w13_weight", (_SRC + "gate_up_proj",), "expert_slice_transposed_interleaved"),
    Rule(_X + r"w2_weight", (_SRC + "down_proj",), "expert_slice_transposed"),
    *_BIASES,
    *_TOP,
)


def source_rules(names: set, interleaved: bool) -> tuple:
    """gpt-oss's gate/up always alternate (`interleaved` cannot change that: convert refuses otherwise)."""
    if any(n.endswith("mlp.experts.gate_up_proj_blocks") for n in names):
        return "gpt-oss release (MXFP4 experts, gate/up interleaved)", RELEASE
    return "transformers (bf16 experts [E, in, out], gate/up interleaved)", TRANSFORMERS


def roots(names: set) -> dict:
    return {"m": "model.", "h": "lm_head."}


def canonical(name: str, layout: str) -> str:
    return name  # the porter layout is the only one gpt-oss writes


def experts_of(canonical: str) -> Optional[tuple]:
    return (canonical, None) if _STACKED.fullmatch(canonical) else None
