"""A decode step (token [B, 1] -> last logits [B, V]) replayed from CUDA graphs, on one GPU or several.

The step is cut into segments, one per run of consecutive stages (embedding, each decoder layer, final
norm + lm_head) on the same device; each segment is one CUDA graph captured on its device. Between
segments the residual [B, 1, H] is copied from one segment's static output into the next one's static
input (a cross-device copy, ordered by torch against both devices' streams). With one device there is one
segment and no copy.

Everything a segment reads sits in static buffers: the token, each device's positions (refreshed from the
cache's next_pos before every replay) and the cache itself; attention covers all cache slots (static
kv_len) and finds each row's keys from its position. Segments are captured on first use, after two eager
warm-up steps that compute the same step (so the cache entries they write are the ones the step needs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import groupby
from typing import Optional

import torch

from runtime.cache import Step


def why_not(model) -> Optional[str]:
    """None if a decode step of `model` can be captured, else the reason (one line)."""
    devices = {model.embed_tokens.device, model.head_device, *model.layer_devices}
    if any(d.type != "cuda" for d in devices):
        return f"CUDA graphs need every layer on a CUDA device; the model is on {sorted(map(str, devices))}"
    if not isinstance(model.layers, list):
        return "the layers are streamed (lazy=True): each step loads weights, which a graph cannot hold"
    return None


@dataclass
class Segment:
    device: torch.device
    first: int  # stages [first, last): 0 = embedding, 1..L = decoder layers, L + 1 = final norm + lm_head
    last: int
    pos: torch.Tensor  # [B, 1] positions on this device (static)
    h_in: Optional[torch.Tensor] = None  # [B, 1, H] static input (None for the segment holding the embedding)
    out: Optional[torch.Tensor] = None  # its output: the residual, or the logits [B, V] for the last one
    graph: Optional[torch.cuda.CUDAGraph] = None


class DecodeGraph:
    """`graph(tok [B, 1]) -> logits [B, V]`, advancing the cache by one token.

    split_after: extra cut points (decoder layer indices) on top of the device changes; one GPU with a
    cut runs the same hand-off as a model spread over several GPUs."""

    def __init__(self, model, cache, split_after: tuple = ()):
        why = why_not(model)
        if why is not None:
            raise ValueError(f"CUDA-graph decoding: {why}")
        self.model, self.cache = model, cache
        B = cache.next_pos.shape[0]
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=model.embed_tokens.device)
        self.segments = self._segments(B, set(split_after))

    def _segments(self, B: int, cuts: set) -> list[Segment]:
        m, L = self.model, len(self.model.layers)
        devices = [m.embed_tokens.device, *m.layer_devices, m.head_device]  # per stage
        keys = [(devices[s], sum(1 for c in cuts if c + 1 < s)) for s in range(L + 2)]  # cut after layer c
        out, start = [], 0
        for (dev, _), run in groupby(keys):
            n = len(list(run))
            pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
            out.append(Segment(dev, start, start + n, pos))
            start += n
        return out

    def _run(self, seg: Segment, h: Optional[torch.Tensor]) -> torch.Tensor:
        """Stages [first, last) of one segment, eagerly (captured when called under graph capture)."""
        m, L = self.model, len(self.model.layers)
        step = Step(seg.pos, None, self.cache.max_len, decode=True)
        for s in range(seg.first, seg.last):
            if s == 0:
                h = m.embed(self.tok)  # [B, 1, H]
            elif s <= L:
                h = m.layers[s - 1](h, step, self.cache.layers[s - 1])
            else:
                h = m.final(h)[:, -1]  # [B, V]
        return h

    def _refresh_positions(self) -> None:
        for seg in self.segments:
            seg.pos.copy_(self.cache.next_pos[:, None], non_blocking=True)

    def _eager_step(self) -> None:
        h = None
        for seg in self.segments:
            with _on(seg.device):
                h = self._run(seg, None if h is None else h.to(seg.device))

    def _capture(self) -> None:
        self._refresh_positions()
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):  # warm-up: allocations and autotuning stay out of the graphs
            for _ in range(2):
                self._eager_step()
        main.wait_stream(side)
        for seg in self.segments:
            torch.cuda.synchronize(seg.device)
        prev = None
        for seg in self.segments:
            with _on(seg.device):
                if prev is not None:
                    seg.h_in = torch.empty_like(prev.out, device=seg.device)
                seg.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(seg.graph):
                    seg.out = self._run(seg, seg.h_in)
            prev = seg

    def _replay(self) -> torch.Tensor:
        prev = None
        for seg in self.segments:
            with _on(seg.device):
                if prev is not None:
                    seg.h_in.copy_(prev.out)
                seg.graph.replay()
            prev = seg
        return prev.out

    @torch.inference_mode()
    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        if self.cache.length + 1 > self.cache.max_len:
            raise ValueError(f"KV cache holds {self.cache.max_len} tokens; {self.cache.length + 1} needed")
        self.tok.copy_(tok)
        if self.segments[0].graph is None:
            self._capture()
        else:
            self._refresh_positions()
        logits = self._replay()
        self.cache.length += 1
        self.cache.next_pos += 1
        return logits


def _on(device: torch.device):
    if device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
