"""Canonical names of routed experts in the `block_sparse_moe` layout (Mixtral's naming, used by more than
one family): one expert's 2-D weights `model.layers.{l}.block_sparse_moe.experts.{e}.w1/w2/w3.weight`
(w1 gate, w3 up, w2 down) and porter's stacked `w13_weight` [E, 2I, H] / `w2_weight` [E, H, I]. A family
whose experts use it takes `EXPERTS` (converters/experts.py's ExpertNames) and the size rules its experts
obey (`EXPERT_SIZE_RULES`) from here.
"""

from __future__ import annotations

import re

from converters.experts import ExpertNames
from porter.format.sizes import Count, Dim

# one routed expert's 2-D weight (vendor layout, hf layout): layer, expert, w1 | w2 | w3
PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
STACKED_EXPERTS = re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.experts\.(w13|w2)_weight$")


def experts_w13_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w13_weight"


def experts_w2_name(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.experts.w2_weight"


def expert_name(layer: int, e: int, w: str) -> str:
    """Canonical name of one expert's 2-D weight: w1 gate, w3 up, w2 down."""
    return f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"


EXPERTS = ExpertNames(experts_w13_name, experts_w2_name, expert_name, PER_EXPERT)

_MOE = r"model\.layers\.\d+\.block_sparse_moe\."
_EXPERTS = _MOE + r"experts\."
# What the routed experts' tensors fix of the config (porter/format/sizes.py runs them) in every layout of this
# naming: per-expert w1/w2/w3, transformers' fused gate_up_proj/down_proj, porter's stacked w13/w2, the router.
EXPERT_SIZE_RULES = (
    Count(
        "num_local_experts",
        r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w[123]\.weight",
        "experts",
        "layer",
    ),
    Dim(("num_local_experts",), _EXPERTS + r"(w13_weight|w2_weight|gate_up_proj|down_proj)", 0),
    Dim(("num_local_experts",), _MOE + r"(gate\.weight|e_score_correction_bias)", 0),
    Dim(("intermediate_size",), _EXPERTS + r"\d+\.w[13]\.weight", 0),
    Dim(("intermediate_size",), _EXPERTS + r"\d+\.w2\.weight", 1),
    Dim(("intermediate_size",), _EXPERTS + r"(w13_weight|gate_up_proj)", 1, factor=2),
    Dim(("intermediate_size",), _EXPERTS + r"(w2_weight|down_proj)", 2),
)
