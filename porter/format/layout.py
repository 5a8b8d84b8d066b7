"""Artifact naming and the output-tensor plan record, shared by every architecture.

This is the format layer (docs/architecture.md): it knows how a porter artifact names things, not what
any model is. A converter (converters/<arch>/) plans `OutTensor`s; the conversion writes them; the
runtime and verify find a weight's scale with `scale_name`. Format: docs/artifact-format.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# read(source tensor name) -> tensor; read(name, e) -> row e along dim 0 of that tensor, read alone
# (the conversion also passes a reader of the sources' scale rows: see OutTensor)
ReadFn = Callable[..., torch.Tensor]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def scale_name(weight_name: str, layout: str = "porter") -> str:
    """Name of the uint8 scale stored beside a quantized weight: `X.weight` -> `X.weight_scale`,
    `X.w13_weight` -> `X.w13_weight_scale`. In the hf layout (the vendor release's names) `X.weight` ->
    `X.weight_scale_inv`, the only scale name sglang loads (docs/serving-engines.md)."""
    if layout == "hf" and weight_name.endswith(".weight"):
        return weight_name + "_scale_inv"
    return (
        weight_name[: -len("weight")] + "weight_scale"
        if weight_name.endswith("weight")
        else weight_name + "_scale"
    )


def is_scale_name(name: str) -> bool:
    return name.endswith(("_scale", "_scale_inv"))


def layer_of(name: str) -> Optional[int]:
    """Decoder layer index of an artifact tensor name (`model.layers.{l}.…`), None outside the layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


@dataclass
class OutTensor:
    """One output tensor, produced lazily from source tensors (tensor-at-a-time conversion).

    Exactly one of the two builders is set:
    - `read_whole(read) -> Tensor`: the whole tensor (plain tensors);
    - `read_expert_rows(read, e) -> [Tensor, ...]`: expert e of a stacked [E, N, K] tensor as row parts
      ([rows, K] each, concatenated along dim 0 they give [N, K]), so a converter never copies to concat.
    A builder only picks rows: it reads, indexes along dim 0, slices, reorders and concatenates rows, and
    never touches the last dim or the values. The conversion relies on that: given a reader of source
    scale tensors ([..., K/32] uint8) the same builder yields the scale rows of its value, which is how
    a pre-quantized MXFP8 source keeps its own scale bytes (porter.engine.run.Pipeline.read_scale).
    Use the methods `build`, `build_expert` and `expert_rows` rather than the fields.
    """

    name: str
    shape: tuple
    dtype: torch.dtype  # dtype of the value before quantization (the source dtype)
    sources: list  # source tensor names read to make it
    read_whole: Optional[Callable[[ReadFn], torch.Tensor]] = None
    read_expert_rows: Optional[Callable[[ReadFn, int], list]] = None
    quantize: bool = False
    carried: bool = False  # a source tensor outside the text model, kept under its own name (the hf layout
    # does not rename it; the runtime reads it as is)
    layout: str = "porter"  # the artifact layout whose naming the tensor follows (its scale's name)

    def __post_init__(self):
        if (self.read_whole is None) == (self.read_expert_rows is None):
            raise TypeError(f"OutTensor {self.name}: give exactly one of read_whole / read_expert_rows")

    @property
    def scale(self) -> str:
        """The name of this tensor's scale when it is quantized."""
        return scale_name(self.name, self.layout)

    @property
    def per_expert(self) -> bool:
        """A stacked [E, N, K] expert tensor, built one expert at a time."""
        return self.read_expert_rows is not None

    def expert_rows(self, read: ReadFn, e: int) -> list:
        """Expert e as row parts ([rows, K] each), reading only that expert's source rows."""
        return self.read_expert_rows(read, e)

    def build_expert(self, read: ReadFn, e: int) -> torch.Tensor:
        """Expert e of a stacked expert tensor: [N, K]."""
        return torch.cat(self.expert_rows(read, e))

    def build(self, read: ReadFn) -> torch.Tensor:
        """The whole tensor; stacked experts are built expert by expert: [E, N, K]."""
        if self.per_expert:
            return torch.stack([self.build_expert(read, e) for e in range(self.shape[0])])
        return self.read_whole(read)


def ignored_layers(out: list[OutTensor]) -> list[str]:
    """Module names of the 2-D linears left unquantized (the `ignored_layers` of a quantization_config)."""
    return [
        t.name[: -len(".weight")]
        for t in out
        if not t.quantize and t.name.endswith(".weight") and len(t.shape) == 2
    ]
