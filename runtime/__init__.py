"""porter runtime: run a converted MiniMax-M3 artifact (or the original HF checkpoint, as the reference).

    import runtime
    model = runtime.load("out/m3-mxfp8", device="cuda")          # backend="auto"|"torch"|"triton"|"flashinfer-trtllm"
    logits = model(input_ids)                                    # [B, T] -> [B, T, V] fp32
    tokens = model.generate(input_ids, max_new_tokens=32)        # greedy, KV cache
    logits, states = model(input_ids, output_hidden_states=True) # residual stream after each layer
    model = runtime.load(path, lazy=True)                        # one decoder layer resident at a time

See runtime/models/minimax_m3.py (layer-at-a-time API) and runtime/loader.py (memory model, streaming).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from runtime.loader import ArtifactStore, LoadError, SourceStore, build_model, open_store
from runtime.moe import BackendUnavailable, make_moe, resolve_backend

__all__ = ["load", "LoadError", "BackendUnavailable"]

log = logging.getLogger("porter.runtime")


def load(path, device="cpu", dtype: Optional[torch.dtype] = None, backend: str = "auto", lazy: bool = False):
    """Load a porter artifact dir (porter.json) or an original MiniMax-M3 HF checkpoint dir (or an already
    opened store from runtime.loader.open_store, which the caller keeps, e.g. to read weights or close()).

    dtype: compute dtype (default float32 on CPU, bfloat16 on CUDA). backend: MoE backend, checked against
    the device before any weight is read (BackendUnavailable with a one-line reason). lazy: stream decoder
    layers (runtime.loader.LazyLayers) instead of materializing all of them.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    store = path if hasattr(path, "names") and hasattr(path, "get") else open_store(path)  # an opened store
    quantized = any(n.endswith("experts.w13_weight_scale") for n in store.names())
    name = resolve_backend(backend, device, quantized=quantized)
    log.info("loading %s on %s (%s, MoE backend %s, lazy=%s)", store.path, device, dtype, name, lazy)
    return build_model(store, device, dtype, lambda quant, routing: make_moe(name, quant, routing), lazy)
