"""The causal LM every runtime model shares: embeddings, decoder layers (each a family's DecoderLayer, possibly
on different devices), final norm + lm_head, position-indexed caches, generate and CUDA-graph decode.

A family's model file (runtime/models/<arch>.py) subclasses `CausalLM` with its norm and caches; the loader
(runtime/loader.py) builds it from the registry (runtime/models/__init__.py). Shapes: B batch, T new tokens,
H hidden, V vocab.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from runtime.cache import KVCache, LayerCache, Step
from runtime.generate import generate
from runtime.graph import DecodeGraph, why_not
from runtime.models.layers import on_device, rms_norm
from runtime.text import GenerationConfig


class CausalLM:
    """`model(ids) -> logits`, `model.generate(ids, max_new_tokens)`; built by runtime.load.

    A family's model subclasses it, naming its norm (`norm_offset`: 1.0 for Gemma's (1 + w), 0.0 for a plain
    RMSNorm) and its caches (`cache_block`: the slot granularity decode attention walks; `layer_cache`).

    With a device_map, decoder layer i lives on layer_devices[i] (embeddings on the first device, final
    norm and lm_head on the last) and the residual stream moves between them."""

    norm_offset = 1.0

    def __init__(self, cfg, top: dict, layers, device, dtype, layer_devices=None):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.tokenizer, self.generation_config = None, GenerationConfig()  # set by runtime.load
        self.embed_tokens, self.norm = (
            top["model.embed_tokens.weight"],
            top["model.norm.weight"],
        )  # [V, H], [H]
        self.lm_head = top.get("lm_head.weight", self.embed_tokens)  # [V, H] (tied if absent)
        self.layers = layers  # list of DecoderLayer, or runtime.loader.LazyLayers
        self.layer_devices = (
            [torch.device(d) for d in layer_devices]
            if layer_devices is not None
            else [self.device] * cfg.num_hidden_layers
        )
        self.head_device = self.lm_head.device
        # (key, cache, DecodeGraph) of the last generate call on CUDA, reused by the next one of that key
        self.decode_state = None

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.embed_tokens.device)
        return F.embedding(ids, self.embed_tokens).to(self.dtype)  # [B, T, H]

    def final(self, h: torch.Tensor) -> torch.Tensor:
        with on_device(self.norm.device):
            h = rms_norm(h.to(self.norm.device), self.norm, self.cfg.rms_norm_eps, self.norm_offset)
        return F.linear(h.to(self.lm_head.device), self.lm_head.to(h.dtype)).float()  # [B, T, V]

    @property
    def cache_block(self) -> int:
        """Cache slots come in whole blocks of this many (decode attention walks the cache by blocks)."""
        return 1

    def layer_cache(self, i: int, batch: int, slots: int, device=None) -> LayerCache:
        """Layer i's empty cache (dense attention: k/v), on its device (or `device`)."""
        return LayerCache.empty(self.cfg, False, batch, slots, self.dtype, device or self.layer_devices[i])

    def cache_slots(self, max_len: int) -> int:
        """Slots of a cache for max_len positions: rounded up to whole cache blocks."""
        return -(-max_len // self.cache_block) * self.cache_block

    def cache_nbytes(self, batch: int, max_len: int) -> dict:
        """{device: bytes} new_cache(batch, max_len) allocates, measured on caches made on the meta device
        (nothing is allocated): generate checks them against free memory first."""
        slots, need = self.cache_slots(max_len), {}
        for i, dev in enumerate(self.layer_devices):
            lc = self.layer_cache(i, batch, slots, device="meta")
            held = sum(t.numel() * t.element_size() for t in (lc.k, lc.v, lc.idx_k) if t is not None)
            need[dev] = need.get(dev, 0) + held
        return need

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """Caches of max_len slots (rounded up to whole cache blocks), each on its layer's device."""
        slots = self.cache_slots(max_len)
        layers = [self.layer_cache(i, batch, slots) for i in range(self.cfg.num_hidden_layers)]
        return KVCache(layers, torch.zeros(batch, dtype=torch.long, device=self.embed_tokens.device))

    def make_step(self, batch: int, T: int, cache: Optional[KVCache], attention_mask=None) -> Step:
        """Positions of T new tokens per row: each row continues at cache.next_pos; with an attention_mask
        ([B, T], 1 = real token, left padding) pad tokens get position 0 and are not cached."""
        dev = self.embed_tokens.device
        valid = None if attention_mask is None else attention_mask.to(dev).bool()
        if valid is not None and bool(valid.all()):
            valid = None
        start = (
            cache.next_pos[:, None]
            if cache is not None
            else torch.zeros(batch, 1, dtype=torch.long, device=dev)
        )
        if valid is None:
            pos = start + torch.arange(T, device=dev)  # [B, T]
        else:
            pos = torch.where(valid, start + valid.long().cumsum(1) - 1, 0)
        first = cache is None or cache.length == 0
        kv_len = (cache.length if cache is not None else 0) + T  # >= every row's last position + 1
        if cache is not None and kv_len > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} tokens; {kv_len} needed (raise max_len)")
        decode = cache is not None and T == 1 and valid is None
        if decode:  # whole index blocks (decode_attention walks the cache block by block)
            kv_len = min(-(-kv_len // self.cache_block) * self.cache_block, cache.max_len)
        return Step(pos, valid, kv_len, fresh=first and valid is None, decode=decode)

    def run_layers(
        self, h: torch.Tensor, step: Step, cache: Optional[KVCache], states: Optional[list] = None
    ):
        for i in range(len(self.layers)):
            h = self.layers[i](h, step, cache.layers[i] if cache is not None else None)
            if states is not None:
                states.append(h)
        return h

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        cache: Optional[KVCache] = None,
        output_hidden_states=False,
        attention_mask: Optional[torch.Tensor] = None,
    ):
        """input_ids [B, T] -> logits [B, T, V] fp32 (and the residual streams if asked). attention_mask
        [B, T] (1 real, 0 pad; left padding) runs prompts of different lengths together: each row's
        logits at its real tokens are what the row gives alone."""
        B, T = input_ids.shape
        step = self.make_step(B, T, cache, attention_mask)
        h = self.embed(input_ids)
        states = [h] if output_hidden_states else None
        h = self.run_layers(h, step, cache, states)
        if cache is not None:
            cache.length += T
            cache.next_pos += T if step.valid is None else step.valid.sum(1)
        logits = self.final(h)
        return (logits, states) if output_hidden_states else logits

    def generate(self, prompt, max_new_tokens=None, **options):
        """Continue prompts: text (a string or a list of them; chat=True applies the chat template) -> the
        completion text; ids (a LongTensor [B, T], a list of ints, or a list of lists) -> prompt + new ids.

        Defaults come from generation_config.json (EOS, max_new_tokens, sampling); options:
        eos_token_id, attention_mask, do_sample, temperature, top_p, top_k, seed, stop (strings),
        stream (callable(row, text) as text is generated), chat, cuda_graph (None: on CUDA whenever the
        step can be captured). See runtime/generate.py."""
        return generate(self, prompt, max_new_tokens, **options)

    def why_no_graph(self):
        """None if a decode step can be captured, else the reason."""
        return why_not(self)

    def decode_graph(self, cache):
        return DecodeGraph(self, cache)

    def release_decode_state(self) -> None:
        """Free the KV cache and captured decode step that generate keeps for its next call."""
        self.decode_state = None


class DecoderLayerBase:
    """What every family's DecoderLayer shares: the call convention (a Step, or absolute positions with a pad
    mask), moving the residual stream to the layer's device and making that device current, and the list of
    Linears. A family sets `device`, `self_attn` and `mlp` and writes `forward(h, step, cache)`."""

    def linears(self) -> list:
        """Every Linear of the layer (stacked ones too): routers and routed experts are not Linears."""
        return self.self_attn.linears() + self.mlp.linears()

    def moe_backend(self):
        """The routed experts' MoE backend (runtime.moe), None on a dense layer."""
        return getattr(self.mlp, "experts", None)

    def __call__(
        self,
        h: torch.Tensor,
        positions,
        cache: Optional[LayerCache] = None,
        valid: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """h [B, T, H] residual stream; positions: a Step, or absolute positions [T] / [B, T] (= cache slots)
        with valid [B, T] (False = pad token) -> [B, T, H] on this layer's device."""
        step = positions if isinstance(positions, Step) else Step.of(positions, h.shape[0], cache, valid)
        step, h = step.on(self.device), h.to(self.device)
        with on_device(self.device):
            return self.forward(h, step, cache)
