"""model.generate: prompts (text or ids) -> continuations, with the KV cache and a captured decode step.

Text in, text out (the completion); ids in, ids out (prompt + completion). Finished rows (EOS or a stop
string) are padded with the pad id (else their EOS) while the others go on.

Before anything is allocated a call is checked against the model: every token id (the prompt's, the pad id)
inside the vocabulary, the prompt plus the new tokens inside the context (`max_position_embeddings`; a
max_new_tokens given by the call is refused beyond it, a default one is shortened to fit), and the KV cache
those tokens need inside the memory its devices have free. Each refusal is one TextError naming the
numbers and the limit.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from runtime.sampling import RowText, choose, generator_for
from runtime.text import GenerationConfig, TextError, Tokenizer

log = logging.getLogger("porter.runtime")

SYNC_EVERY = 8  # decode steps between checks that every row is done (each check waits for the GPU)


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompt_kind(prompt) -> str:
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, torch.Tensor):
        return "tensor"
    if isinstance(prompt, (list, tuple)) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "texts"
        if _is_ids(prompt):
            return "ids"
        if all(_is_ids(p) and p for p in prompt):
            return "id_rows"
        if all(isinstance(p, dict) for p in prompt):
            return "messages"
    raise TextError(
        "prompt must be a string, a list of strings, a list of chat messages, token ids "
        f"(a list of ints or of lists of ints) or a LongTensor [B, T]; found {type(prompt).__name__}"
    )


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = torch.tensor(list(r), dtype=torch.long)
        mask[i, T - len(r) :] = 1
    return ids, (None if bool(mask.all()) else mask)


def encode(tokenizer: Optional[Tokenizer], kind: str, prompt, chat: bool, pad_id: int):
    """-> ids [B, T], attention mask [B, T] or None."""
    if kind in ("text", "texts", "messages"):
        if tokenizer is None:
            raise TextError(
                "text prompts need the checkpoint's tokenizer.json (none was found); pass token ids"
            )
        if kind == "messages":  # one conversation: always through the chat template
            rows = [tokenizer.encode(tokenizer.apply_chat_template(list(prompt)), add_special_tokens=False)]
        elif chat:  # the template writes the special tokens itself
            texts = [prompt] if kind == "text" else list(prompt)
            rows = [
                tokenizer.encode(tokenizer.apply_chat_template(t), add_special_tokens=False) for t in texts
            ]
        else:
            rows = [tokenizer.encode(t) for t in ([prompt] if kind == "text" else prompt)]
        if not all(rows):
            raise TextError("a prompt tokenizes to nothing")
        return _left_pad(rows, pad_id)
    if chat:
        raise TextError("chat=True needs text prompts, not token ids")
    if kind == "ids":
        return torch.tensor([list(prompt)], dtype=torch.long), None
    if kind == "id_rows":
        return _left_pad(prompt, pad_id)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.dtype not in (torch.long, torch.int, torch.int32) or prompt.shape[1] == 0:
        raise TextError(
            f"input_ids must be an integer tensor [B, T] with T >= 1, found {prompt.dtype} "
            f"{tuple(prompt.shape)}"
        )
    return prompt.long(), None


def _last_logits(logits: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, T, V] -> the logits at each row's last real token [B, V]."""
    if mask is None:
        return logits[:, -1]
    B, T = mask.shape
    cols = torch.arange(T, device=logits.device) * mask.to(logits.device).long()  # [B, T]
    return logits[torch.arange(B, device=logits.device), cols.argmax(1)]


def cache_slots(tokens: int, block: int) -> int:
    """Slots of a reusable decode cache for `tokens` positions: rounded up to eighths of an octave (so
    prompts of similar length share one captured step, reading at most 1/8 more cache than they need) and
    to whole cache blocks (the model's cache_block)."""
    step = max(block, 1 << max(tokens.bit_length() - 4, 0))
    return -(-tokens // step) * step


class Decoder:
    """The decode step of one generate call: a captured graph (CUDA) or the eager forward.

    The cache and the graph captured over it are kept on the model (`model.decode_state`) and reused by
    the next call with the same batch and cache size: capturing costs two eager steps plus the capture,
    which a short call would otherwise pay again every time (docs/runtime.md)."""

    def __init__(self, model, batch: int, tokens: int, cuda_graph: Optional[bool]):
        self.model, self.graph = model, None
        if model.device.type == "cuda" if cuda_graph is None else cuda_graph:
            why = model.why_no_graph()
            if why is None:
                self.cache, self.graph = self._kept(model, batch, tokens)
                return
            if cuda_graph:
                raise ValueError(f"cuda_graph=True: {why}")
            log.info("decoding eagerly: %s", why)
        self.cache = model.new_cache(batch, tokens)

    @staticmethod
    def _kept(model, batch: int, tokens: int):
        """(cache, graph) kept on the model for this batch and cache size, the cache emptied in place."""
        key = (batch, cache_slots(tokens, model.cache_block))
        if model.decode_state is None or model.decode_state[0] != key:
            model.decode_state = None  # free the old cache and graph before allocating the new ones
            cache = model.new_cache(*key)
            model.decode_state = (key, cache, model.decode_graph(cache))
        _, cache, graph = model.decode_state
        cache.reset()
        return cache, graph

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        """tok [B, 1] -> logits [B, V]."""
        return self.graph(tok) if self.graph is not None else self.model(tok, self.cache)[:, -1]


def generate(
    model,
    prompt,
    max_new_tokens: Optional[int] = None,
    *,
    eos_token_id=None,
    attention_mask: Optional[torch.Tensor] = None,
    do_sample: Optional[bool] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    seed: Optional[int] = None,
    stop: Sequence[str] = (),
    stream: Optional[Callable[[int, str], None]] = None,
    chat: bool = False,
    cuda_graph: Optional[bool] = None,
):
    """See the models' generate (runtime/models/)."""
    kind = _prompt_kind(prompt)
    cfg = model.generation_config.with_overrides(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        do_sample=do_sample,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    if isinstance(stop, str):
        stop = [stop]
    pad_id = _pad_id(cfg, model.tokenizer)
    ids, mask = encode(model.tokenizer, kind, prompt, chat, pad_id)
    if attention_mask is not None:
        mask = attention_mask
    check_token_ids(model, ids, pad_id, from_tokenizer=kind in ("text", "texts", "messages"))
    cfg = fit_context(model, ids.shape[1], cfg, given=max_new_tokens is not None)
    if cfg.max_new_tokens:  # no new token, no cache
        check_cache_fits(model, ids.shape[0], ids.shape[1] + cfg.max_new_tokens)
    texts = RowText(model.tokenizer, ids.shape[0], stop, stream)
    out = _decode(model, ids, mask, cfg, pad_id, seed, texts, cuda_graph)  # [B, T + n]
    return _result(kind, out, ids.shape[1], cfg, texts, mask)


def check_token_ids(model, ids, pad_id: Optional[int] = None, from_tokenizer: bool = False) -> None:
    """Every id the embedding will look up (the prompt's [B, T] or list, the pad id) inside the vocabulary;
    from_tokenizer: the ids are the checkpoint tokenizer's encoding of text."""
    vocab = model.embed_tokens.shape[0]
    where = "config.json vocab_size"
    ids = torch.as_tensor(ids, dtype=torch.long)
    if pad_id is not None and not 0 <= pad_id < vocab:
        raise TextError(
            f"pad token id {pad_id} (generation_config.json pad_token_id, else the tokenizer's pad or EOS "
            f"token) is outside the model's vocabulary of {vocab} ({where}); fix generation_config.json"
        )
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < vocab:
        return
    bad = lo if lo < 0 else hi
    if from_tokenizer:
        tok = model.tokenizer.path if model.tokenizer is not None else "tokenizer.json"
        raise TextError(
            f"{tok} gives token id {bad}, outside the model's vocabulary of {vocab} ({where}): the "
            "tokenizer does not belong to this model; use the checkpoint's own tokenizer.json"
        )
    raise TextError(
        f"token id {bad} is outside the model's vocabulary of {vocab} ({where}); pass ids in [0, {vocab})"
    )


def fit_context(model, T: int, cfg: GenerationConfig, given: bool) -> GenerationConfig:
    """The prompt (T tokens, padding included) plus max_new_tokens inside the model's context: a prompt
    longer than it, or a max_new_tokens the call gave beyond it, is refused; a default one is shortened."""
    limit, n = model.cfg.max_position_embeddings, cfg.max_new_tokens
    where = "max_position_embeddings in config.json"
    if T > limit or (T == limit and n > 0):
        raise TextError(
            f"the prompt is {T:,} tokens, {'longer than' if T > limit else 'all of'} the model's context of "
            f"{limit:,} ({where}); shorten it"
        )
    if T + n <= limit:
        return cfg
    if given:
        raise TextError(
            f"prompt ({T:,} tokens) + max_new_tokens ({n:,}) = {T + n:,} exceeds the model's context of "
            f"{limit:,} tokens ({where}); ask for at most {limit - T:,} new tokens"
        )
    log.info(
        "max_new_tokens %d -> %d: the prompt's %d tokens leave no more of the %d-token context",
        n,
        limit - T,
        T,
        limit,
    )
    return cfg.with_overrides(max_new_tokens=limit - T)


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory a new allocation on `device` can take: CUDA's free memory plus what torch's allocator holds
    unused; on the CPU the machine's MemAvailable (None when unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def check_cache_fits(model, batch: int, tokens: int) -> None:
    """The KV cache of `tokens` positions for `batch` rows fits the memory its devices have free (a cache
    generate keeps from an earlier call is counted as free: it is replaced)."""
    slots = cache_slots(tokens, model.cache_block)  # the larger of the two sizes a Decoder makes
    kept = 0 if model.decode_state is None else _cache_bytes(model.decode_state[1])
    for dev, need in model.cache_nbytes(batch, slots).items():
        free = free_bytes(torch.device(dev))
        if free is not None and need > free + kept:
            raise TextError(
                f"the KV cache for {batch} x {tokens:,} tokens needs {_human(need)} on {dev}, which has "
                f"{_human(free + kept)} free; ask for fewer new tokens, a shorter prompt or a smaller batch"
            )


def _human(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _cache_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size() for lc in cache.layers for t in (lc.k, lc.v, lc.idx_k) if t is not None
    )


def _pad_id(cfg: GenerationConfig, tokenizer: Optional[Tokenizer]) -> int:
    for pad in (cfg.pad_token_id, tokenizer.pad_token_id if tokenizer is not None else None):
        if pad is not None:
            return pad
    return cfg.eos_token_ids[0] if cfg.eos_token_ids else 0


@torch.inference_mode()
def _decode(model, ids, mask, cfg: GenerationConfig, pad_id: int, seed, texts: RowText, cuda_graph):
    dev = model.embed_tokens.device
    out, n = ids.to(dev), cfg.max_new_tokens
    if n == 0:
        return out
    B, T = out.shape
    decoder = Decoder(model, B, T + n, cuda_graph if n > 1 else False)
    last = _last_logits(model(out, decoder.cache, attention_mask=mask), mask)
    gen = None if cfg.greedy else generator_for(seed, last.device)
    eos = torch.tensor(cfg.eos_token_ids or [-1], device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    steps = torch.full((B,), n, dtype=torch.long, device=dev)  # tokens each row produced (its EOS included)
    new = []
    for i in range(n):
        nxt = torch.where(done, pad_id, choose(last, cfg, gen).to(dev))  # [B]
        new.append(nxt)
        ended = torch.isin(nxt, eos) & ~done
        if texts.active:  # rows that just ended on EOS add nothing to their text
            hit = texts.add(nxt.tolist(), (~done & ~ended).tolist())
            ended |= torch.tensor(hit, device=dev)
        steps = torch.where(ended, i + 1, steps)
        done = done | ended
        # Asking the GPU whether every row is done waits for this step; without a text check that wait
        # happens every SYNC_EVERY steps only, and the extra steps are cut below
        if i == n - 1 or ((texts.active or (i + 1) % SYNC_EVERY == 0) and bool(done.all())):
            break
        last = decoder(nxt[:, None])
    return torch.cat([out, torch.stack(new, 1)[:, : int(steps.max())]], 1)


def _result(kind: str, out: torch.Tensor, T: int, cfg: GenerationConfig, texts: RowText, mask):
    rows = out.tolist()
    finals = None
    if kind in ("text", "texts", "messages") or texts.active:  # the text also ends the stream
        ends = set(cfg.eos_token_ids)
        finals = [texts.text(i, _until(r[T:], ends)) for i, r in enumerate(rows)]
    if kind == "tensor":
        return out
    if kind in ("ids", "id_rows"):
        lens = mask.sum(1).tolist() if mask is not None else [T] * len(rows)
        rows = [r[T - n :] for r, n in zip(rows, lens)]
        return rows[0] if kind == "ids" else rows
    return finals if kind == "texts" else finals[0]


def _until(new: list, ends: set) -> list:
    """The generated ids before the first EOS."""
    return next((new[:j] for j, t in enumerate(new) if t in ends), new)
