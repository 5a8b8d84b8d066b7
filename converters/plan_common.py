"""The parts of an output plan every family builds the same way: the option checks, the order of the
top-level tensors, a plain (non-expert) tensor, the carried ones, the check that the checkpoint holds every
tensor the config needs. Architecture-free: a family hands in its scope of `--quantize all` and its names.
"""

from __future__ import annotations

import re

from converters.experts import read_one
from porter.errors import LayoutError, PorterError
from porter.format.layout import OutTensor

QUANTIZE = ("experts", "all", "none")
_TOP = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def check_options(quantize: str, layout: str, layouts: tuple, family: str = "") -> None:
    """PorterError unless --quantize and --layout are ones the family writes (`family` named when given)."""
    if quantize not in QUANTIZE:
        raise PorterError(f"--quantize must be experts, all or none, not {quantize!r}")
    if layout not in layouts:
        where = f" for {family}" if family else ""
        raise PorterError(f"--layout must be one of {', '.join(layouts)}{where}, not {layout!r}")


def top_order(name: str) -> tuple:
    """Sort key of the tensors outside the layers: embeddings, final norm, lm_head, then the rest by name."""
    return (_TOP.index(name) if name in _TOP else len(_TOP)), name


def plain_tensor(c: str, src: str, src_meta: dict, quantize: str, all_scope: re.Pattern) -> OutTensor:
    """A tensor copied as read; quantized only under --quantize all when `all_scope` matches its name."""
    dtype, shape = src_meta[src]
    q = quantize == "all" and bool(all_scope.match(c))
    return OutTensor(c, tuple(shape), dtype, [src], read_one(src), quantize=q)


def carried_tensors(carried, src_meta: dict) -> list[OutTensor]:
    """Tensors outside the text model, kept under their source names as read, in name order."""
    out = []
    for src in sorted(carried):
        dtype, shape = src_meta[src]
        out.append(OutTensor(src, tuple(shape), dtype, [src], read_one(src), carried=True))
    return out


def top_level_needs(cfg) -> list:
    """The tensors outside the layers every checkpoint holds (lm_head unless tied to the embeddings)."""
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        need.append("lm_head.weight")
    return need


def top_level_shapes(cfg) -> dict:
    """{name: shape} of the tensors outside the layers, from the config."""
    return {
        "model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
        "lm_head.weight": (cfg.vocab_size, cfg.hidden_size),
        "model.norm.weight": (cfg.hidden_size,),
    }


def require_tensors(need: list, canon: dict) -> None:
    """LayoutError naming the first tensor the config needs that the checkpoint lacks."""
    missing = [n for n in need if n not in canon]
    if missing:
        raise LayoutError(
            f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. {missing[0]!r}; "
            "check that config.json belongs to these weights"
        )
