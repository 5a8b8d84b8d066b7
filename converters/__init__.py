"""Architecture converters, and the registry that picks one from config.json's `model_type`.

A converter is a module under converters/ providing the `converters.base.Converter` protocol (config
resolution, the output plan, tensor names, the hf layout). `MODEL_TYPES` maps each model_type porter
reads to its converter module's name, imported on first use (as mlx-lm's MODEL_REMAPPING or llama.cpp's
TEXT_MODEL_MAP). Callers never import a converter module directly:

    conv, cfg = converters.resolve(raw_config, tensors, where)  # sizes checked against the files first
    conv = converters.for_config(raw_config)                    # without the files: the config alone
    cfg = conv.resolve_config(raw_config)

Adding an architecture: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Optional

from converters.base import Converter, ResolvedConfig, conformance_problems
from porter.errors import ConfigError
from porter.format import sizes

# config.json model_type -> converter module under converters/.
# MiniMax-M3: the vendor VL wrapper (text model in `text_config`), transformers' text-only layout, and
# the vendor text_config's own model_type, which a bare text config carries at the top level.
MODEL_TYPES = {
    "minimax_m3_vl": "minimax_m3",
    "minimax_m3_vl_text": "minimax_m3",
    "minimax_m3": "minimax_m3",
    # MiniMax-M2 and its point releases (one architecture): the release and transformers' layouts share it
    "minimax_m2": "minimax_m2",
    "gpt_oss": "gpt_oss",  # OpenAI gpt-oss (20b, 120b): the MXFP4 release and transformers' bf16 layout
}


def supported() -> tuple[str, ...]:
    """Every model_type porter converts, sorted."""
    return tuple(sorted(MODEL_TYPES))


def get(model_type, where: str = "config.json") -> Converter:
    """The converter of `model_type`; ConfigError (naming it and the supported ones) if there is none."""
    module = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if module is None:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not an architecture porter converts "
            f"(supported: {', '.join(supported())})"
        )
    return _load(module)


def for_config(raw, where: str = "config.json") -> Converter:
    """The converter for a raw config.json dict, by its top-level `model_type`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must hold a JSON object")
    return get(raw.get("model_type"), where)


def resolve(
    raw, tensors: dict, where: str = "config.json", converter: Optional[Converter] = None
) -> tuple[Converter, ResolvedConfig]:
    """The converter (given, or the one for_config picks) and resolved config of a raw config.json whose
    files hold `tensors` ({name: (dtype, shape, ...)} from the safetensors headers): its size fields are
    checked against those tensors first (check_sizes), so that no absurd size reaches a loop or an
    allocation."""
    converter = converter or for_config(raw, where)
    check_sizes(converter, raw, tensors, where)
    return converter, converter.resolve_config(raw)


def check_sizes(converter: Converter, raw, tensors: dict, where: str = "config.json") -> None:
    """ConfigError, naming the field, its value and what the files hold, unless the size fields of `raw`
    (the converter's config_sizes) match `tensors` as the converter's SIZE_RULES say (porter/format/sizes.py)."""
    sizes.check(converter.SIZE_RULES, converter.config_sizes(raw), tensors, converter.canonical_name, where)


@lru_cache(maxsize=None)
def _load(module: str) -> Converter:
    converter = importlib.import_module(f"converters.{module}")
    problems = conformance_problems(converter)
    if problems:  # a porter bug, not bad input: the module under converters/ is incomplete
        raise TypeError(f"converters.{module} does not provide the Converter protocol: {'; '.join(problems)}")
    return converter
