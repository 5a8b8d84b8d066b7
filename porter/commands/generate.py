"""`porter generate`: a prompt to text with the runtime, printed as it is generated."""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

log = logging.getLogger("porter")


def generate(
    path: str,
    prompt: str,
    chat: bool = False,
    max_new_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_p: Optional[float] = None,
    top_k: Optional[int] = None,
    seed: Optional[int] = None,
    stop: tuple = (),
    device: str = "auto",
    backend: str = "auto",
    out=None,
    progress: bool = False,
    rehash: bool = False,
) -> dict:
    """Stream the continuation of `prompt` to `out` (stdout); return {"tokens", "seconds", "tokens_per_s"}.
    progress: a bar on stderr while the weights are read onto the GPUs (runtime.load); rehash: every byte
    read onto them hashed (runtime.load)."""
    import runtime
    from runtime.generate import check_token_ids
    from runtime.text import TextError

    out = out or sys.stdout
    model = runtime.load(path, device=device, backend=backend, progress=progress, rehash=rehash)
    if model.tokenizer is None:
        raise TextError(f"{path}: no tokenizer.json; porter generate needs the checkpoint's tokenizer")
    sampled = temperature is not None and temperature > 0

    def show(row: int, text: str) -> None:
        out.write(text)
        out.flush()

    start = time.perf_counter()
    ids = _prompt_ids(model, prompt, chat)
    check_token_ids(model, ids, from_tokenizer=True)  # named as the tokenizer's, not as ids a caller gave
    new = model.generate(
        ids,
        max_new_tokens,
        do_sample=sampled or None,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=list(stop),
        stream=show,
    )
    seconds = time.perf_counter() - start
    counted = len(new) - len(ids)
    out.write("\n")
    rate = counted / seconds if seconds > 0 else float("inf")
    log.info("%d tokens in %.2f s: %.1f tokens/s (prefill included)", counted, seconds, rate)
    return {"tokens": counted, "seconds": seconds, "tokens_per_s": rate}


def _prompt_ids(model, prompt: str, chat: bool) -> list[int]:
    tok = model.tokenizer
    if chat:
        return tok.encode(tok.apply_chat_template(prompt), add_special_tokens=False)
    return tok.encode(prompt)
