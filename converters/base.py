"""What an architecture's converter provides: a small core (`Converter`) and optional capabilities.

A converter is a module (converters/<arch>/ or converters/<arch>.py) whose top-level names satisfy
`Converter`; the registry in converters/__init__.py picks it from config.json's `model_type`, and
porter (convert, inspect, verify) and the runtime's stores use only these names. Two capabilities are
optional, each a module-like object the converter exposes under a core name (None when absent):

- `hf_layout` (`HfLayout`): writing the vendor release's layout that serving engines load (`--layout hf`)
  and reading it back as canonical names. A converter with one lists "hf" in `LAYOUTS`.
- `verify_rules` (`VerifyRules`): how `porter verify` re-derives each artifact tensor from the source,
  written apart from the converter's plan (a bug in the plan must not be on both sides of the check).

The resolved config a converter returns satisfies `ResolvedConfig`, the part of it that architecture-free
code reads. Adding an architecture: docs/adding-a-model.md.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Protocol, get_type_hints

from porter.format.layout import OutTensor


class ResolvedConfig(Protocol):
    """The resolved text-model config, as architecture-free code reads it (porter.json, inspect, verify)."""

    num_hidden_layers: int
    gate_up_interleaved: bool  # a fused source gate_up_proj's rows alternate gate/up
    eos_token_id: object  # int, list of ints or None
    provenance: dict  # field -> "config:<key>" | "legacy:<key>" | "default..."
    STRUCTURAL: tuple  # fields that fix tensor shapes: a reference differing there is not the source

    def to_dict(self) -> dict: ...

    def is_moe(self, layer: int) -> bool: ...

    def layer_kind(self, layer: int) -> str:
        """A short label of one decoder layer's kind for reports, e.g. "full/moe"."""


class Converter(Protocol):
    """The core: everything callers take from an architecture's converter module."""

    ARCHITECTURE: str  # the name porter.json records; also the runtime model registry's key
    MODEL_TYPES: tuple  # the config.json model_types it reads (the registry's keys for it)
    LAYOUTS: tuple  # output layouts plan_tensors writes: "porter" and, with the hf_layout capability, "hf"
    DEFAULT_SCOPE: dict  # layout -> the --quantize scope used when none is given
    hf_layout: object  # the HfLayout capability, or None
    verify_rules: object  # the VerifyRules capability, or None
    SIZE_RULES: tuple  # porter.format.sizes rules: what in the files each config size field must match

    def resolve_config(self, raw: dict) -> ResolvedConfig:
        """config.json (raw) -> the resolved config, each field with its provenance; ConfigError names a
        bad field."""

    def config_sizes(self, raw: dict) -> dict:
        """The size fields SIZE_RULES speak of, {field: (value, config key)}, read from config.json (raw)
        without building anything from them (no per-layer or per-expert list): converters.resolve checks
        them against the files before resolve_config runs."""

    def manifest_facts(self, cfg: ResolvedConfig) -> dict:
        """What porter.json records beyond the resolved config: {"architecture": name, "activation":
        {"name": ..., parameters..., "provenance": {parameter: where}}, ...}; re-derivable from the config
        alone (verify recomputes it from the artifact's config.json and compares)."""

    def source_layout(self, raw: dict, names) -> str:
        """A label of the source checkpoint's layout (e.g. "vendor", "transformers") from its config and
        tensor names, for reports."""

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
        """Source (or hf-layout) tensor name -> canonical name, None for tensors outside the text model
        (carried under their own names)."""


class HfLayout(Protocol):
    """The `hf_layout` capability: the vendor release's layout, which vLLM and sglang load."""

    def check_hf_source(self, raw: dict, where: str = "config.json") -> None:
        """ConfigError unless this source can be written in the hf layout."""

    def hf_config_json(self, raw: dict, qconfig: Optional[dict]) -> dict:
        """The hf-layout artifact's config.json, with `qconfig` as its quantization_config."""

    def hf_quantization_config(self, out: list, quantize: str, scale_rounding: str) -> Optional[dict]:
        """The hf layout's quantization_config for a plan (None when nothing is quantized)."""

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


class VerifyRules(Protocol):
    """The `verify_rules` capability: verify's own source -> artifact table, written independently of the
    converter's plan (a module that imports nothing of its converter package)."""

    def source_rules(self, names: set, interleaved: bool) -> tuple:
        """(label of the source layout, the rules in priority order) for a checkpoint's tensor names."""

    def roots(self, names: set) -> dict:
        """Template fields fixed per checkpoint (e.g. {"m": model root, "h": lm_head root})."""

    def canonical(self, name: str, layout: str) -> str:
        """An artifact tensor name of `layout` ("porter" | "hf") -> the canonical name the rules are
        written for."""

    def experts_of(self, canonical: str) -> Optional[tuple]:
        """(stacked [E, N, K] canonical name, expert index or None) for a routed-expert weight: a stacked
        tensor gives (itself, None), one expert's 2-D weight (hf layout) (its stacked tensor, e); None for
        anything else."""


CAPABILITIES = {"hf_layout": HfLayout, "verify_rules": VerifyRules}


def protocol_members(proto: type = Converter) -> dict:
    """{name: "function" | "constant"} for every member of a protocol class."""
    functions = {
        n: "function" for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")
    }
    constants = {n: "constant" for n in proto.__annotations__}
    return {**constants, **functions}


def conformance_problems(module) -> list[str]:
    """What `module` lacks of the Converter protocol and of each capability it provides: missing names,
    non-callables, functions whose parameters are not the protocol's (same names in the same order), and
    LAYOUTS naming "hf" exactly when the hf_layout capability is there. Empty when it conforms."""
    problems = _members_problems(module, Converter, "")
    for cap, proto in CAPABILITIES.items():
        value = getattr(module, cap, None)
        if value is not None:
            problems += _members_problems(value, proto, f"{cap}.")
    layouts = getattr(module, "LAYOUTS", ())
    if isinstance(layouts, tuple) and ("hf" in layouts) != (getattr(module, "hf_layout", None) is not None):
        problems.append('LAYOUTS lists "hf" exactly when the hf_layout capability is provided')
    return problems


def _members_problems(obj, proto: type, prefix: str) -> list[str]:
    problems = []
    hints = get_type_hints(proto)
    for name, kind in protocol_members(proto).items():
        if not hasattr(obj, name):
            problems.append(f"{prefix}{name} is missing")
            continue
        value = getattr(obj, name)
        if kind == "constant":
            want_type = hints[name]
            if want_type is not object and not isinstance(value, want_type):
                problems.append(f"{prefix}{name} is a {type(value).__name__}, not a {want_type.__name__}")
            continue
        if not callable(value):
            problems.append(f"{prefix}{name} is not callable")
            continue
        want = list(inspect.signature(getattr(proto, name)).parameters)[1:]  # without self
        have = list(inspect.signature(value).parameters)
        if have != want:
            problems.append(
                f"{prefix}{name}{tuple(have)} does not take the protocol's parameters {tuple(want)}"
            )
    return problems
