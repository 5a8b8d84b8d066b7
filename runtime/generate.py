"""Greedy generation over the KV cache (what `MiniMaxM3.generate` runs)."""
from __future__ import annotations

from typing import Optional

import torch

from runtime.graph import DecodeGraph


def last_logits(logits: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """logits [B, T, V] -> [B, V] at each row's last real token (left padding: the last column)."""
    if attention_mask is None:
        return logits[:, -1]
    B, T = attention_mask.shape
    cols = torch.arange(T, device=logits.device) * attention_mask.to(logits.device).long()
    return logits[torch.arange(B, device=logits.device), cols.argmax(1)]


@torch.inference_mode()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None,
             attention_mask: Optional[torch.Tensor] = None, cuda_graph: bool = False) -> torch.Tensor:
    """Greedy decoding with the KV cache (incl. the indexer key cache) -> [B, T + n]. attention_mask:
    left-padded prompts. cuda_graph: replay one captured decode step (CUDA, single device). Stops early
    when every row's new token is eos_token_id."""
    out = input_ids.to(model.embed_tokens.device)
    B, T = out.shape
    cache = model.new_cache(B, T + max_new_tokens)
    last = last_logits(model(out, cache, attention_mask=attention_mask), attention_mask)
    graph = DecodeGraph(model, cache) if cuda_graph and max_new_tokens > 1 else None
    for _ in range(max_new_tokens):
        nxt = last.argmax(-1, keepdim=True).to(out.device)  # [B, 1]
        out = torch.cat([out, nxt], dim=1)
        if eos_token_id is not None and bool((nxt == eos_token_id).all()):
            break
        if out.shape[1] < T + max_new_tokens:
            last = graph(nxt) if graph is not None else model(nxt, cache)[:, -1]
    return out
