"""Decode steps replayed from a CUDA graph (`model.generate(..., cuda_graph=True)`)."""
from __future__ import annotations

import torch

from runtime.cache import KVCache, Step


class DecodeGraph:
    """One decode step (token [B, 1] -> last logits [B, V]) captured in a CUDA graph over a fixed cache.

    Everything the step reads sits in static buffers: the token, the cache's next_pos (advanced after
    each replay), and the cache itself; attention covers all cache slots (static kv_len) and finds each
    row's keys from its position. Captured on first use (the warm-up and the capture compute the same
    step, so the cache entries they write are the ones the step needs). model: a
    runtime.models.minimax_m3.MiniMaxM3 on one CUDA device."""

    def __init__(self, model, cache: KVCache):
        devices = {model.embed_tokens.device, model.head_device, *model.layer_devices}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"CUDA-graph decoding needs the whole model on one CUDA device; "
                             f"it is on {devices}")
        self.model, self.cache, self.graph = model, cache, None
        B = cache.next_pos.shape[0]
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=cache.next_pos.device)
        self.step = Step(cache.next_pos[:, None], None, cache.max_len, decode=True)
        self.logits = None

    def _run(self) -> torch.Tensor:
        self.step._memo.clear()  # cos/sin etc. must be computed inside the graph, from the live positions
        h = self.model.embed(self.tok)
        h = self.model.run_layers(h, self.step, self.cache)
        return self.model.final(h)[:, -1]  # [B, V]

    @torch.inference_mode()
    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        if self.cache.length + 1 > self.cache.max_len:
            raise ValueError(f"KV cache holds {self.cache.max_len} tokens; {self.cache.length + 1} needed")
        self.tok.copy_(tok)
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._run()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._run()
        self.graph.replay()
        self.cache.length += 1
        self.cache.next_pos += 1
        return self.logits
