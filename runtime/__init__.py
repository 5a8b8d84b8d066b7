"""porter runtime: run a converted artifact (or the original HF checkpoint, as the reference).

    import runtime
    model = runtime.load("out/model-mxfp8", device="cuda")    # + its tokenizer and generation_config.json
    print(model.generate("The capital of France is"))      # text in, text out (greedy; EOS from the config)
    model.generate(["a", "b"], 32, do_sample=True, temperature=0.7, top_p=0.9, seed=0)  # batched, sampled
    model.generate("hi", chat=True, stop=["\n\n"], stream=lambda row, text: print(text, end=""))
    tokens = model.generate(input_ids, 32)                 # LongTensor [B, T] -> [B, T + n]
    logits = model(input_ids)                              # [B, T] -> [B, T, V] fp32
    logits, states = model(input_ids, output_hidden_states=True)  # residual stream after each layer
    model = runtime.load(path, lazy=True)                  # one decoder layer resident at a time
    model = runtime.load(path, moe_numerics="serving")     # MoE with the TRT-LLM kernel's W8A8 numerics
    runtime.set_numerics(model, "w8a16")                   # switched in place: no weight read again
    model = runtime.load(path, device_map="auto", max_memory={0: "70GiB", 1: "70GiB"})  # layers over GPUs
    model = runtime.load(path, device="cuda", progress=True)  # a bar while the shards stream onto the GPU
    model = runtime.load(path, device="cuda", rehash=True)  # hash every byte, even of shards checked before

On CUDA, decode steps replay captured CUDA graphs (one per device's run of layers) unless
cuda_graph=False. Modules: loader.py (stores, memory model, streaming) · staging.py (loading onto GPUs at the
disk's and the bus's speed, digests checked) · placement.py (device_map) · models/ (the registry: one
forward pass per architecture; building blocks in models/layers.py) · cache.py (positions, KV and indexer
caches) · text.py (tokenizer, chat template, generation defaults) · sampling.py · generate.py · graph.py
(captured decode) · kernels/ (attention, fused decode ops, GEMVs + their Triton kernels) · moe/ (contract,
backends, selection).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from porter.devices import resolve_device, resolve_dtype
from porter.errors import BackendUnavailable, LoadError, PlacementError
from runtime import models
from runtime.loader import LazyLayers, Numerics, build_model, loading, open_store
from runtime.moe import check_numerics, check_numerics_name, make_moe, resolve_backend
from runtime.placement import resolve as resolve_placement
from runtime.text import load_generation_config, load_tokenizer

__all__ = ["load", "set_numerics", "LoadError", "BackendUnavailable", "PlacementError"]

log = logging.getLogger("porter.runtime")


def load(
    path,
    device="cpu",
    dtype=None,
    backend: str = "auto",
    lazy: bool = False,
    device_map=None,
    max_memory: Optional[dict] = None,
    moe_fp8_prefill: bool = True,
    moe_numerics: Optional[str] = None,
    progress: bool = False,
    rehash: bool = False,
):
    """Load a porter artifact dir (porter.json) or an original HF checkpoint dir (or an already
    opened store from runtime.loader.open_store, which the caller keeps, e.g. to read weights or close()).

    dtype: compute dtype (default float32 on CPU, bfloat16 on CUDA). backend: MoE backend, checked against
    the device before any weight is read (BackendUnavailable with a one-line reason). lazy: stream decoder
    layers (runtime.loader.LazyLayers) instead of materializing all of them.
    device_map: "auto" (whole layers over the visible GPUs by byte size; budgets from max_memory
    {device: bytes | "70GiB"} or each GPU's free memory) or {"layers.N": device, ...}; overrides `device`.
    A model that does not fit is refused before any weight is read (PlacementError, one line).
    moe_fp8_prefill: the Triton MoE backend runs prefills of 512+ tokens with e4m3 activations (SM89+;
    faster, slightly larger error: docs/moe-backends.md); False keeps them on the W8A16 path.
    moe_numerics: "w8a16" | "serving" (default: the MoE backend's own, w8a16 for torch and triton; "serving"
    quantizes the MoE input and SwiGLU output to MXFP8 as the TRT-LLM kernel does, and the input of every
    MXFP8 linear (`--quantize all`) as the engines' W8A8 MXFP8 linear does; docs/moe-backends.md).
    progress: a progress bar on stderr (bytes, GB/s, ETA) while weights are read onto the GPUs.
    rehash: hash every staged tensor, even in shards an earlier load on this machine checked and that have
    not changed since (by default those are trusted: porter/format/checked.py); what it checks is recorded.

    An artifact loaded onto GPUs is read at the disk's and the bus's speed and each tensor checked against
    porter.json's digest on the way (runtime/staging.py): a truncated or changed shard raises LoadError
    naming it, and no model is returned. This machine records the shards it checked; a later load of the
    same files, unchanged since, reads them without hashing (a change through the file system is seen).
    """
    check_numerics_name(moe_numerics)  # before anything is opened
    resolve_device(device)  # a device or dtype this machine cannot honour fails before any file is read
    resolve_dtype(dtype, torch.device("cpu"))
    opened = not (hasattr(path, "names") and hasattr(path, "get"))  # else: an opened store the caller keeps
    store = open_store(path, record_checks=True, rehash=rehash) if opened else path
    try:
        return _load(
            store,
            device,
            dtype,
            backend,
            lazy,
            device_map,
            max_memory,
            moe_fp8_prefill,
            moe_numerics,
            progress,
        )
    except BaseException:
        if opened:  # a refused load (PlacementError, BackendUnavailable, ...) leaves no shard handle open
            store.close()
        raise


def _load(
    store, device, dtype, backend, lazy, device_map, max_memory, moe_fp8_prefill, moe_numerics, progress=False
):
    placement = None
    if device_map is not None:
        if lazy:
            raise PlacementError(
                "device_map and lazy=True do not combine: streaming keeps one layer resident"
            )
        placement = resolve_placement(device_map, store, max_memory)
        device = placement.embed
        log.info("device_map: %s", placement.describe())
    device = resolve_device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = resolve_dtype(dtype, device)
    quantized = models.for_store(store).experts_quantized(store.config, store.names())
    name = resolve_backend(backend, device, quantized=quantized)
    check_numerics(moe_numerics, name, quantized)
    log.info("loading %s on %s (%s, MoE backend %s, lazy=%s)", store.path, device, dtype, name, lazy)
    make_backend = lambda quant, routing: make_moe(
        name, quant, routing, moe_numerics, fp8_prefill=moe_fp8_prefill
    )
    with loading(store, device, placement, lazy, progress) as bar:  # staged onto GPUs, checked
        model = build_model(
            store,
            device,
            dtype,
            make_backend,
            lazy,
            Numerics(name, quantized, moe_numerics),
            placement,
            progress=bar,
        )
    if lazy and device.type == "cuda":
        model.layers.stream_from(store, device)  # onto a GPU: staged layer reads, the next one read ahead
    model.placement = placement
    model.tokenizer = load_tokenizer(store.path)
    model.generation_config = load_generation_config(store.path, model.tokenizer)
    return model


def set_numerics(model, moe_numerics: Optional[str]) -> None:
    """Switch a loaded model to the numerics runtime.load(moe_numerics=) would have given it, without reading
    a weight: the layers built now change in place, a layer-streaming model builds its later layers so
    (runtime.loader.Numerics). Refused as load refuses (MoeNumericsError, BackendUnavailable: one line) what
    the model's MoE backend does not compute, and then nothing changes. A captured decode step holds the old
    numerics: it is dropped."""
    n = model.numerics
    check_numerics(moe_numerics, n.moe_backend, n.quantized)
    n.moe = moe_numerics
    for layer in model.layers.resident() if isinstance(model.layers, LazyLayers) else model.layers:
        n.apply(layer)
    model.release_decode_state()
