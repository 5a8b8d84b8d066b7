"""Greedy generation with the converted model only, scored by one teacher-forced pass of the reference.

The reference is never decoded token by token (at 427B, streaming every layer once per token takes
hours): the converted model generates (resident when it fits the device), then the reference runs once
over prompt + continuation (numerics.py, layer-streamed when needed) and is scored at every position:
KL(ref || conv), top-1 agreement, and the first position where the reference's argmax differs from the
token the converted model chose. On a causal model the logits at position t of one pass over the whole
sequence are the logits a token-by-token run gives at step t (tested on the tiny model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from porter.commands.verify.numerics import kl_per_position
from porter.commands.verify.verdict import GenerationRow
from porter.errors import VerifyInputError

log = logging.getLogger("porter")

DEFAULT_MAX_NEW_TOKENS = 16
STREAM_FRACTION = 0.8  # a model "fits" when it needs at most this fraction of the available memory
READ_GBPS = 2.0  # weight read rate assumed by the estimates (NVMe class; a network disk is slower)


def memory_available(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


@dataclass
class RunPlan:
    stream: bool  # layer streaming for the teacher-forced pass of both models
    stream_reason: str
    new_tokens: int
    generation: str  # resident | streaming | skipped (why, and how to ask for it)
    device_map: Optional[str] = None  # "auto": the converted model generates spread over every visible GPU


def generation_budget(device: torch.device, device_map: Optional[str] = "auto") -> tuple[int, Optional[str]]:
    """Bytes free for the converted model, and the device_map to load it with (None: `device` alone).
    With device_map "auto", a bare `cuda` device and several visible GPUs, whole layers are spread over
    all of them (runtime.load(device_map="auto")); device_map None keeps the model on `device`."""
    if device_map not in ("auto", None):
        raise VerifyInputError(f"--device-map must be auto or none, not {device_map!r}")
    spread = device_map == "auto" and device.type == "cuda" and device.index is None
    count = torch.cuda.device_count() if spread else 0
    if count > 1:
        return sum(memory_available(torch.device("cuda", i)) for i in range(count)), "auto"
    return memory_available(device), None


def plan_runs(
    streaming,
    max_new_tokens: Optional[int],
    device: torch.device,
    conv_bytes: int,
    ref_bytes: int,
    device_map: Optional[str] = "auto",
    rounded_bytes: int = 0,
) -> RunPlan:
    """rounded_bytes: the rounded reference (the source re-quantized as the artifact is: its size), 0 when
    there is none (nothing quantized). log_costs() says what the plan reads."""
    avail = memory_available(device)
    gb = lambda b: f"{b / 1e9:.2f} GB"
    models = "the three models" if rounded_bytes else "both models"
    need = f"{models} need ~{gb(conv_bytes + ref_bytes + rounded_bytes)}, {gb(avail)} available on {device}"
    if streaming in (True, False):
        stream, why = streaming, "requested" if streaming else "requested off"
    elif streaming == "auto":
        stream, why = conv_bytes + ref_bytes + rounded_bytes > STREAM_FRACTION * avail, f"auto: {need}"
    else:
        raise VerifyInputError(f"streaming must be auto, True or False, not {streaming!r}")
    gen_avail, device_map = generation_budget(device, device_map)
    where = "the visible GPUs" if device_map else str(device)
    fits = conv_bytes <= STREAM_FRACTION * gen_avail
    n = max_new_tokens if max_new_tokens is not None else (DEFAULT_MAX_NEW_TOKENS if fits else 0)
    if n == 0:
        mode = (
            "skipped: --max-new-tokens 0"
            if max_new_tokens == 0
            else f"skipped: the converted model ({gb(conv_bytes)}) does not fit {gb(gen_avail)} on {where}; "
            f"--max-new-tokens N generates anyway with layer streaming (reads {gb(conv_bytes)} per token)"
        )
    else:
        mode = (
            ("resident" + (" over the visible GPUs (device_map auto)" if device_map else ""))
            if fits
            else "streaming"
        )
    return RunPlan(stream, why, n, mode, device_map if fits else None)


def log_costs(plan: RunPlan, conv_bytes: int, ref_bytes: int, rounded_bytes: int = 0) -> None:
    """The bytes each pass reads (rounded_bytes: the rounded reference's size, 0 when there is none), and the
    time those reads take at READ_GBPS; the compute is measured on the first layers as the pass runs
    (numerics.py logs the projected total)."""
    per_token = conv_bytes if plan.generation == "streaming" else 0
    gen_bytes = conv_bytes + per_token * max(plan.new_tokens - 1, 0) if plan.new_tokens else 0
    # resident, the rounded reference reads the artifact's proved MXFP8 tensors and the source's carried
    # ones (its size); layer-streamed, it takes every source tensor from the bf16 reference's reads
    # (rounded.py) and exact bytes reads the artifact's layers inside the pass (verify/__init__.py)
    score_bytes = conv_bytes + ref_bytes + (conv_bytes if plan.stream else rounded_bytes)
    est = lambda b: (
        f"reads ~{b / (READ_GBPS * 1e9):.1f} s at an assumed {READ_GBPS:g} GB/s, compute not counted"
    )
    if plan.new_tokens:
        log.info(
            "verify: generation (%d tokens, converted model %s) reads %.3f GB (%s)",
            plan.new_tokens,
            plan.generation,
            gen_bytes / 1e9,
            est(gen_bytes),
        )
    else:
        log.info("verify: generation %s", plan.generation)
    log.info(
        "verify: teacher-forced pass (reference%s + converted, %s) reads %.3f GB (%s; "
        "the first layer's time gives the projected total)",
        ", rounded reference" if rounded_bytes else "",
        "layer-streaming, exact bytes in it" if plan.stream else "full load",
        score_bytes / 1e9,
        est(score_bytes),
    )


def greedy(model, ids: torch.Tensor, n: int, eos) -> list:
    """The converted model's greedy continuation of ids [1, P] (new token ids)."""
    return model.generate(ids, max_new_tokens=n, eos_token_id=eos)[0, ids.shape[1] :].tolist()


def greedy_all(model, ids: list, n: int, eos) -> list:
    """Continuations of every prompt, decoded as one left-padded batch (each row computes what it computes
    alone: the runtime keeps pad tokens out of the KV cache)."""
    if len(ids) < 2:
        return [greedy(model, x, n, eos) for x in ids]
    width = max(x.shape[1] for x in ids)
    batch = torch.zeros(len(ids), width, dtype=torch.long)  # [B, P], left padding (token 0, masked)
    mask = torch.zeros_like(batch)
    for i, x in enumerate(ids):
        batch[i, width - x.shape[1] :], mask[i, width - x.shape[1] :] = x[0], 1
    rows = model.generate(batch, max_new_tokens=n, eos_token_id=eos, attention_mask=mask)[:, width:].tolist()
    # a row that met eos keeps going until every row has: cut it where a lone run would have stopped
    return [row[: row.index(eos) + 1] if eos is not None and eos in row else row for row in rows]


def teacher_forced_input(ids: torch.Tensor, continuation: list) -> torch.Tensor:
    """Prompt + continuation without its last token: the positions whose logits predict each new token."""
    if len(continuation) <= 1:
        return ids
    return torch.cat([ids, torch.tensor([continuation[:-1]], dtype=ids.dtype)], dim=1)


def score(
    prompt: str, continuation: list, ref_tail: torch.Tensor, conv_tail: torch.Tensor, tok
) -> GenerationRow:
    """ref_tail / conv_tail [n, V]: logits at positions P-1 .. P+n-2 of the teacher-forced pass."""
    n = len(continuation)
    lr, lc = ref_tail[:n], conv_tail[:n]
    ref_arg = lr.argmax(-1).tolist()
    first = next((j for j, (a, b) in enumerate(zip(ref_arg, continuation)) if a != b), None)
    return GenerationRow(
        prompt,
        continuation,
        tok.decode(continuation),
        ref_arg,
        tok.decode(ref_arg),
        kl_per_position(lr, lc).tolist(),
        (lr.argmax(-1) == lc.argmax(-1)).double().tolist(),
        first,
    )
