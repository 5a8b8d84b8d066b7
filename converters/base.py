"""What an architecture's converter provides: the `Converter` protocol.

A converter is a module (converters/<arch>/ or converters/<arch>.py) whose top-level names satisfy
`Converter`; the registry in converters/__init__.py picks it from config.json's `model_type`, and
porter (convert, inspect, verify) and the runtime's stores use only these names. The resolved config it
returns satisfies `ResolvedConfig`, the part of it that architecture-free code reads. Adding an
architecture: docs/architecture.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Protocol, get_type_hints

import torch

from porter.format.layout import OutTensor


class ResolvedConfig(Protocol):
    """The resolved text-model config, as architecture-free code reads it (porter.json, inspect, verify)."""

    num_hidden_layers: int
    gate_up_interleaved: bool  # a fused source gate_up_proj's rows alternate gate/up
    eos_token_id: object  # int, list of ints or None
    provenance: dict  # field -> "config:<key>" | "legacy:<key>" | "default..."

    def to_dict(self) -> dict: ...

    def is_moe(self, layer: int) -> bool: ...

    def is_sparse_attention(self, layer: int) -> bool: ...


class Converter(Protocol):
    """Everything callers take from an architecture's converter module."""

    ARCHITECTURE: str  # the name porter.json records
    MODEL_TYPES: tuple  # the config.json model_types it reads (the registry's keys for it)
    LAYOUTS: tuple  # output layouts plan_tensors writes: "porter" and, if it has one, "hf"
    DEFAULT_SCOPE: dict  # layout -> the --quantize scope used when none is given
    HF_ARCHITECTURES: list  # config.json `architectures` of the hf layout
    verify_rules: object  # verify's own source table for this architecture (a module), or None: verify's
    # built-in MiniMax-M3 tables (porter/commands/verify/mapping.py)

    # config
    def resolve_config(self, raw: dict) -> ResolvedConfig:
        """config.json (raw) -> the resolved config, each field with its provenance; ConfigError names a
        bad field."""

    def manifest_facts(self, cfg: ResolvedConfig) -> dict:
        """What porter.json records beyond the resolved config: {"architecture": name, ...}."""

    # the plan and names
    def plan_tensors(
        self,
        cfg: ResolvedConfig,
        src_meta: dict,
        quantize: str = "experts",
        gate_up: str = "auto",
        layout: str = "porter",
    ) -> list[OutTensor]:
        """Every output tensor in write order from the source headers {name: (dtype, shape)}; LayoutError
        names a missing, unexpected or mis-shaped tensor."""

    def canonical_name(self, src: str) -> Optional[str]:
        """Source tensor name -> canonical name, None for tensors outside the text model (carried)."""

    def experts_w13_name(self, layer: int) -> str:
        """Canonical name of a layer's stacked [E, 2I, H] gate/up expert weight."""

    def experts_w2_name(self, layer: int) -> str:
        """Canonical name of a layer's stacked [E, H, I] down expert weight."""

    def interleave_gate_up(self, w: torch.Tensor) -> torch.Tensor:
        """[..., 2I, H] [gate; up] -> rows gate0, up0, gate1, up1, ... (a fused source's other order)."""

    def uninterleave_gate_up(self, w: torch.Tensor) -> torch.Tensor:
        """Inverse of interleave_gate_up."""

    # the hf layout (the vendor release's, which serving engines load)
    def check_hf_source(self, raw: dict, where: str = "config.json") -> None:
        """ConfigError unless this source can be written in the hf layout."""

    def hf_config_json(self, raw: dict, qconfig: Optional[dict]) -> dict:
        """The hf-layout artifact's config.json, with `qconfig` as its quantization_config."""

    def hf_quantization_config(self, out: list, quantize: str, scale_rounding: str) -> Optional[dict]:
        """The hf layout's quantization_config for a plan (None when nothing is quantized)."""

    def hf_ignored_layers(self, out: list) -> list:
        """Module paths of the plan's text-model linears left unquantized, as the engines match them."""

    def hf_name(self, canonical: str) -> str:
        """Canonical name -> hf-layout name."""

    def hf_canonical_map(self, names) -> dict:
        """hf-layout tensor names -> {canonical: hf name | [[hf row parts] per expert]} (what the runtime
        reads)."""


@dataclass(frozen=True)
class Rule:
    """One row of a verify source table: artifact (canonical) names matching `artifact` (a regex, full
    match) are derived from `sources` (name templates) by `op` (the ops: porter/commands/verify/mapping.py)."""

    artifact: str
    sources: tuple
    op: str = "copy"


def protocol_members(proto: type = Converter) -> dict:
    """{name: "function" | "constant"} for every member of a protocol class."""
    functions = {
        n: "function" for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")
    }
    constants = {n: "constant" for n in proto.__annotations__}
    return {**constants, **functions}


def conformance_problems(module) -> list[str]:
    """What `module` lacks of the Converter protocol: missing names, non-callables, and functions whose
    parameters are not the protocol's (same names in the same order). Empty when it conforms."""
    problems = []
    for name, kind in protocol_members().items():
        if not hasattr(module, name):
            problems.append(f"{name} is missing")
            continue
        value = getattr(module, name)
        if kind == "constant":
            want_type = get_type_hints(Converter)[name]
            if not isinstance(value, want_type):
                problems.append(f"{name} is a {type(value).__name__}, not a {want_type.__name__}")
            continue
        if not callable(value):
            problems.append(f"{name} is not callable")
            continue
        want = list(inspect.signature(getattr(Converter, name)).parameters)[1:]  # without self
        have = list(inspect.signature(value).parameters)
        if have != want:
            problems.append(f"{name}{tuple(have)} does not take the protocol's parameters {tuple(want)}")
    return problems
