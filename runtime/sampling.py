"""Choosing the next token (greedy or sampled) and deciding when a row is finished."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from runtime.text import GenerationConfig, Tokenizer


def choose(logits: torch.Tensor, cfg: GenerationConfig, generator: Optional[torch.Generator]) -> torch.Tensor:
    """logits [B, V] fp32 -> next tokens [B]: argmax, or a draw after temperature, top-k and top-p."""
    if cfg.greedy:
        return logits.argmax(-1)
    scores = logits / cfg.temperature  # [B, V]
    if 0 < cfg.top_k < scores.shape[-1]:
        kth = scores.topk(cfg.top_k, dim=-1).values[:, -1:]  # [B, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1:
        scores = _top_p(scores, cfg.top_p)
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability sums to >= top_p (always the most likely one)."""
    sorted_scores, order = scores.sort(dim=-1, descending=True)  # [B, V]
    before = sorted_scores.softmax(-1).cumsum(-1) - sorted_scores.softmax(-1)  # mass of the tokens ahead
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, float("-inf"))


def generator_for(seed: Optional[int], device: torch.device) -> Optional[torch.Generator]:
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(seed))


class RowText:
    """Each row's generated text, decoded incrementally: for stop strings and the streaming callback.

    A token may end inside a multi-byte character; its text is held back until the character completes
    (the decoded text ends in U+FFFD until then)."""

    def __init__(
        self,
        tokenizer: Optional[Tokenizer],
        batch: int,
        stop: Sequence[str],
        stream: Optional[Callable[[int, str], None]],
    ):
        if (stop or stream) and tokenizer is None:
            raise ValueError("stop strings and streaming need the checkpoint's tokenizer.json")
        self.tokenizer, self.stop, self.stream = tokenizer, list(stop), stream
        self.ids = [[] for _ in range(batch)]
        self.shown = [0] * batch  # characters already streamed per row
        self.cut = [None] * batch  # where a stop string starts, once one appeared

    @property
    def active(self) -> bool:
        return bool(self.stop or self.stream)

    def add(self, tokens: list[int], live: list[bool]) -> list[bool]:
        """Append this step's tokens of the live rows; return which rows hit a stop string now."""
        hit = [False] * len(tokens)
        for i, (t, alive) in enumerate(zip(tokens, live)):
            if not alive:
                continue
            self.ids[i].append(t)
            text = self.tokenizer.decode(self.ids[i])
            found = min((j for j in (text.find(s) for s in self.stop) if j >= 0), default=-1)
            if found >= 0:
                self.cut[i], hit[i] = found, True
                text = text[:found]
            elif text.endswith("\ufffd"):
                continue
            self._show(i, text[: len(text) - self._held(text)])
        return hit

    def _held(self, text: str) -> int:
        """Characters at the end that may begin a stop string: not streamed until that is decided."""
        return max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)

    def _show(self, i: int, text: str) -> None:
        if self.stream is not None and len(text) > self.shown[i]:
            self.stream(i, text[self.shown[i] :])
        self.shown[i] = max(self.shown[i], len(text))

    def text(self, i: int, ids: list[int]) -> str:
        """Row i's final text (ids without EOS / padding), cut before a stop string; the rest is streamed."""
        text = self.tokenizer.decode(ids)
        text = text if self.cut[i] is None else text[: self.cut[i]]
        self._show(i, text)
        return text
