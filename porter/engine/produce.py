"""What a unit produces, checked against the plan, and the per-tensor error records built from it."""

from __future__ import annotations

from typing import Optional

import torch

from porter.format import mxfp8
from porter.format.layout import OutTensor
from porter.format.safetensors_io import dtype_name


def quantize_on_cpu(w: torch.Tensor, rounding: str, name: str, keep: Optional[torch.Tensor], sizes: tuple):
    """Yields (first row, q, scale, error sums) per chunk of rows of w; sizes: units.quant_sizes."""
    chunk, tile = sizes
    rows = max(1, chunk // max(1, w.shape[-1])) if w.ndim == 2 else 0
    if w.ndim != 2 or rows >= w.shape[0]:
        yield (0, *mxfp8.quantize_with_error(w, rounding, name, keep_scale=keep, tile_blocks=tile))
        return
    for r in range(0, w.shape[0], rows):
        yield (
            r,
            *mxfp8.quantize_with_error(
                w[r : r + rows],
                rounding,
                name,
                tile_blocks=tile,
                keep_scale=None if keep is None else keep[r : r + rows],
            ),
        )


def check_produced(t: OutTensor, value: torch.Tensor, shape: tuple) -> None:
    if value.dtype != t.dtype or tuple(value.shape) != shape:
        raise RuntimeError(
            f"{t.name}: planned {t.dtype} {shape}, produced {value.dtype} {tuple(value.shape)}"
        )


def check_kept(t: OutTensor, keep: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """keep must be the uint8 scale rows of value ([..., K/32]); anything else means t's builder did more
    than pick rows, so its scale rows cannot follow its value rows."""
    want = tuple(value.shape[:-1]) + (value.shape[-1] // mxfp8.BLOCK,)
    if keep.dtype != torch.uint8 or tuple(keep.shape) != want:
        raise RuntimeError(
            f"{t.name}: its builder applied to the source scales gave {keep.dtype} "
            f"{tuple(keep.shape)}, expected uint8 {want}; a builder may only pick rows"
        )
    return keep


def sum_errs(errs: list) -> dict:
    total = {"err_sq": 0.0, "ref_sq": 0.0, "max_abs_error": 0.0}
    for err in errs:  # plan order: the same float sums whatever the worker count
        total["err_sq"] += err["err_sq"]
        total["ref_sq"] += err["ref_sq"]
        total["max_abs_error"] = max(total["max_abs_error"], err["max_abs_error"])
    return total


def error_record(t: OutTensor, src_dtype, err: dict) -> dict:
    rel = (err["err_sq"] / err["ref_sq"]) ** 0.5 if err["ref_sq"] else 0.0
    return {
        "source_dtype": dtype_name(src_dtype),
        "scale": t.scale,
        "rel_fro_error": rel,
        "max_abs_error": err["max_abs_error"],
    }


def expert_label(t: OutTensor, e: int, read) -> str:
    """Names the source tensor(s) of expert e, the non-finite one first when there is one."""
    n = len(t.sources) // t.shape[0] if len(t.sources) % t.shape[0] == 0 else 0
    srcs = t.sources[e * n : (e + 1) * n] if n else t.sources
    bad = [s for s in srcs if n and not bool(torch.isfinite(read(s).float()).all())]
    return f"{bad[0] if bad else ', '.join(srcs)} (expert {e} of {t.name})"
