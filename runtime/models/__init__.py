"""The runtime's model registry: a converter's ARCHITECTURE (porter.json's `architecture`) -> its model
module under runtime/models/, imported on first use. The loader (runtime/loader.py) picks the model here
from the store's converter; nothing else names a model.

A model module provides (checked on first use by `conformance_problems`):
  Model(cfg, top, layers, device, dtype, layer_devices=None)   the causal LM: forward, generate, caches
  DecoderLayer(cfg, get, i, rope, device, make_backend)        decoder layer i; `linears()` lists its Linears
  moe_block(cfg, get, layer, device, make_backend)             layer's MoE block alone (None for a dense layer)
  experts_quantized(cfg, names) -> bool                        whether the store's routed experts are MXFP8
and optionally
  rope(cfg, device) -> runtime.models.layers.Rope              the model's RoPE (default: plain RoPE over
                                                               cfg.rotary_dim with cfg.rope_theta)
Weights come from `get(canonical name)` (runtime.loader.getter); the canonical names are the converter's.
Adding a model: docs/adding-a-model.md.
"""

from __future__ import annotations

import importlib
from functools import lru_cache

from porter.errors import LoadError

# converter ARCHITECTURE -> module under runtime/models/
MODELS = {
    "minimax_m3": "minimax_m3",
    "minimax_m2": "minimax_m2",
    "gpt_oss": "gpt_oss",
}
MEMBERS = ("Model", "DecoderLayer", "moe_block", "experts_quantized")


def get(architecture: str):
    """The model module of an architecture; LoadError when the runtime has none."""
    module = MODELS.get(architecture)
    if module is None:
        raise LoadError(
            f"the runtime has no model for architecture {architecture!r} (it runs: {', '.join(sorted(MODELS))})"
        )
    return _load(module)


def for_store(store):
    """The model module of an opened store (by its converter's ARCHITECTURE)."""
    return get(store.converter.ARCHITECTURE)


def conformance_problems(module) -> list[str]:
    return [f"{name} is missing" for name in MEMBERS if not callable(getattr(module, name, None))]


@lru_cache(maxsize=None)
def _load(module: str):
    model = importlib.import_module(f"runtime.models.{module}")
    problems = conformance_problems(model)
    if problems:  # a porter bug: the module under runtime/models/ is incomplete
        raise TypeError(f"runtime.models.{module} is not a runtime model: {'; '.join(problems)}")
    return model
