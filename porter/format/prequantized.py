"""Pre-quantized source checkpoints: detect the scheme from config.json, dequantize tensor by tensor.

Three schemes are understood (docs/serving-engines.md, docs/artifact-format.md, docs/mxfp8.md):
- `quant_method: "mxfp8"` — the vendor MXFP8 release and porter's own `--layout hf` output: F8_E4M3
  `X.weight [N, K]` + U8 (or F8_E8M0) `X.weight_scale_inv [N, K/32]`, one UE8M0 byte per 32 along K.
- `quant_method: "fp8"` with `weight_block_size [bn, bk]` (usually [128, 128], DeepSeek-V3 style):
  F8_E4M3 `X.weight [N, K]` + float `X.weight_scale_inv [ceil(N/bn), ceil(K/bk)]`, w = q * scale_inv.
- `quant_method: "mxfp4"` (OpenAI's open-weight releases): U8 `X_blocks [..., N, K/32, 16]` (two E2M1 codes per
  byte) + U8 `X_scales [..., N, K/32]` (porter.format.mxfp4). The weight keeps the name `X_blocks`, now
  a bfloat16 [..., N, K] tensor: its values, exact in bfloat16 (porter.format.mxfp4 refuses the rest).
Anything else is refused with one line. A quantized weight is presented to the planner as a bfloat16
tensor of its shape (its scale disappears from the tensor list) and dequantized when read, so the plan,
the requantization and the error statistics are the same code as for a bf16 source. MXFP8 values are
exactly representable in bfloat16 (3 mantissa bits, same exponent range), so MXFP8 -> MXFP8 with the
rceil rule reproduces every value exactly; block-FP8 products are rounded to bfloat16 once. MXFP8 and MXFP4
sources keep their own scale bytes (`Scheme.keeps_scales`): MXFP8 -> MXFP8 is then the identity on bytes and
MXFP4 -> MXFP8 the exact widening of porter.format.mxfp4.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from porter.errors import PrequantizedError
from porter.format import mxfp4, mxfp8
from porter.format.safetensors_io import dtype_name

SCALE_SUFFIX = ".weight_scale_inv"
MXFP4_VALUES, MXFP4_SCALES = "_blocks", "_scales"  # X_blocks + X_scales of an MXFP4 source
DEQUANTIZED_DTYPE = torch.bfloat16
MAX_BLOCK = 4096  # largest block-FP8 tile side read (real: 128); a scale is expanded over its tile
KEPT_ROWS = "kept-rows"  # options.source_quantization.scale_bytes of an MXFP8 source (Scheme.record)


@dataclass
class Scheme:
    """How a source checkpoint is quantized, and which of its weights carry scales."""

    method: str  # "mxfp8" | "fp8-block" | "mxfp4"
    block: tuple  # (1, 32) for MXFP8 and MXFP4, (bn, bk) for block FP8
    config: dict  # the source's quantization_config, as found
    scales: dict = field(default_factory=dict)  # weight tensor name -> its scale tensor name

    def describe(self) -> str:
        return f"{self.method} (block {list(self.block)}), {len(self.scales)} quantized weights"

    @property
    def keeps_scales(self) -> bool:
        """MXFP8 and MXFP4: re-quantization reuses the source's own scale bytes (`kept_scale`), row for row.

        Why: rceil on dequantized values is lossless but not always byte-identical — a block whose largest
        element rounded down to 224 * 2^e gets exponent e - 1 the second time (same values, other bytes),
        and an MXFP4 block (largest value at most 6) would get a byte up to 6 lower. Keeping the source's
        exponent makes MXFP8 -> MXFP8 the identity on bytes and MXFP4 -> MXFP8 the widening of each code
        (porter.format.mxfp4)."""
        return self.method in ("mxfp8", "mxfp4")

    def record(self) -> dict:
        """How the conversion read this source, as porter.json options.source_quantization records it; verify
        re-derives the artifact by the same rule (docs/verify.md). scale_bytes "kept-rows": every row of a
        quantized value that comes from an MXFP8 source weight (the whole weight, one expert of a fused one,
        a row slice such as a gate / up half) is re-quantized with that source row's own scale bytes, rows
        from an unquantized source with options.scale_rounding; "rederived": every value with
        options.scale_rounding, after one rounding of the dequantized product to `dequantized_dtype`.
        (Artifacts of earlier porters may record "kept": whole source weights only, slices re-derived.)"""
        return {
            "method": self.method,
            "weight_block_size": list(self.block),
            "dequantized_dtype": dtype_name(DEQUANTIZED_DTYPE),
            "scale_bytes": KEPT_ROWS if self.keeps_scales else "rederived",
        }

    def adopt(self, meta: dict, where: str) -> dict:
        """Source tensor metadata as the planner should see it: each quantized weight becomes a bfloat16
        tensor of its (value) shape and its scale is consumed. Checks every pair's dtypes and shapes."""
        if self.method == "mxfp4":
            return self._adopt_mxfp4(meta, where)
        out = {}
        for name, (dtype, shape) in meta.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            scale = name[: -len(".weight")] + SCALE_SUFFIX if name.endswith(".weight") else None
            if scale in meta:
                self._check_pair(name, dtype, shape, meta[scale], where)
                self.scales[name] = scale
                out[name] = (DEQUANTIZED_DTYPE, tuple(shape))
            elif dtype == torch.float8_e4m3fn:
                raise PrequantizedError(
                    f"{where}: tensor {name!r} is float8_e4m3fn but has no {scale or 'scale'} "
                    "beside it; the checkpoint is incomplete"
                )
            else:
                out[name] = (dtype, tuple(shape))
        orphans = [
            n for n in meta if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] + ".weight" not in meta
        ]
        if orphans:
            raise PrequantizedError(f"{where}: scale {orphans[0]!r} has no weight beside it")
        return out

    def _adopt_mxfp4(self, meta: dict, where: str) -> dict:
        out = {}
        for name, (dtype, shape) in meta.items():
            if name.endswith(MXFP4_SCALES) and name[: -len(MXFP4_SCALES)] + MXFP4_VALUES in meta:
                continue
            if not name.endswith(MXFP4_VALUES):
                out[name] = (dtype, tuple(shape))
                continue
            scale = name[: -len(MXFP4_VALUES)] + MXFP4_SCALES
            if scale not in meta:
                raise PrequantizedError(f"{where}: MXFP4 tensor {name!r} has no {scale!r} beside it")
            s_dtype, s_shape = meta[scale]
            if dtype != torch.uint8 or s_dtype not in (
                torch.uint8,
                getattr(torch, "float8_e8m0fnu", torch.uint8),
            ):
                raise PrequantizedError(
                    f"{where}: MXFP4 tensors {name!r} / {scale!r} are {dtype} / {s_dtype}, expected uint8 / uint8"
                )
            mxfp4.check_shapes(tuple(shape), tuple(s_shape), f"{where}: tensor {name!r}")
            self.scales[name] = scale
            out[name] = (DEQUANTIZED_DTYPE, mxfp4.value_shape(tuple(shape)))
        return out

    def _check_pair(self, name, dtype, shape, scale_meta, where):
        s_dtype, s_shape = scale_meta
        if dtype != torch.float8_e4m3fn:
            raise PrequantizedError(
                f"{where}: tensor {name!r} has a scale but dtype {dtype}, expected float8_e4m3fn"
            )
        *lead, n, k = shape
        bn, bk = self.block
        want = (*lead, -(-n // bn), -(-k // bk))
        if self.method == "mxfp8":
            ok_dtype = s_dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
            if k % mxfp8.BLOCK:
                raise PrequantizedError(
                    f"{where}: tensor {name!r} K={k} is not a multiple of 32 (MXFP8 source)"
                )
        else:
            ok_dtype = s_dtype in (torch.float32, torch.bfloat16, torch.float16)
        if not ok_dtype or tuple(s_shape) != want:
            raise PrequantizedError(
                f"{where}: scale of {name!r} is {s_dtype} {list(s_shape)}, expected "
                f"{'uint8' if self.method == 'mxfp8' else 'float32'} {list(want)} "
                f"for {self.method} block {list(self.block)}"
            )

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, where: str = "source tensor") -> torch.Tensor:
        """(values, scale) as stored -> bfloat16 values. where: "FILE: tensor NAME", for the refusal of a
        zeroed scale (zeroed_scale_problem)."""
        if self.method == "mxfp4":
            return mxfp4.dequantize(q, scale.view(torch.uint8), DEQUANTIZED_DTYPE, where)
        if self.method != "mxfp8":
            return mxfp8.dequantize_fp8_block(q, scale, self.block, DEQUANTIZED_DTYPE)
        problem = zeroed_scale_problem(q, scale)
        if problem:
            raise PrequantizedError(f"{where}: {problem}; the checkpoint is damaged, re-download it")
        return mxfp8.dequantize(q, scale.view(torch.uint8), DEQUANTIZED_DTYPE)

    def kept_scale(self, stored_scale: torch.Tensor) -> torch.Tensor:
        """The uint8 [..., K/32] scale bytes a re-quantization keeps, from a source weight's stored scale
        (or the same rows of it: scale rows select, slice and reorder exactly as value rows do)."""
        if not self.keeps_scales:
            raise ValueError(f"a {self.method} source keeps no scale bytes")
        return stored_scale.view(torch.uint8)


def quantization_config_of(raw: dict) -> Optional[dict]:
    """The checkpoint's quantization_config: top level, else inside text_config (vLLM reads both)."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    return qc


def detect(raw: dict, config_path: Path) -> Optional[Scheme]:
    """The source's quantization scheme from its config.json, None for an unquantized checkpoint."""
    qc = quantization_config_of(raw)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise PrequantizedError(f"{config_path}: quantization_config must be an object")
    method = qc.get("quant_method")
    if method in (None, "none"):
        return None
    if "porter_layout" in qc:
        raise PrequantizedError(
            f"{config_path}: a porter-layout artifact (stacked experts) cannot be converted "
            "again; convert its source, or an artifact written with --layout hf"
        )
    block = qc.get("weight_block_size")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise PrequantizedError(
            f"{config_path}: quantization_config.activation_scheme "
            f"{qc.get('activation_scheme')!r} is not supported; porter reads checkpoints "
            "with dynamic activation scales only"
        )
    if method == "mxfp4":
        return Scheme("mxfp4", (1, mxfp4.BLOCK), qc)
    if method == "mxfp8":
        if block not in (None, [1, mxfp8.BLOCK]):
            raise PrequantizedError(
                f"{config_path}: quant_method mxfp8 with weight_block_size {block}; MXFP8 blocks are [1, 32]"
            )
        return Scheme("mxfp8", (1, mxfp8.BLOCK), qc)
    if (
        method == "fp8"
        and isinstance(block, list)
        and len(block) == 2
        and all(type(b) is int and 0 < b <= MAX_BLOCK for b in block)
    ):
        return Scheme("fp8-block", tuple(block), qc)
    if method == "fp8" and block is not None:  # dequantizing expands each scale over bn x bk values
        raise PrequantizedError(
            f"{config_path}: quantization_config.weight_block_size {block!r} is not a "
            f"pair of integers in [1, {MAX_BLOCK}] (block FP8 checkpoints use "
            "[128, 128]); fix config.json"
        )
    what = f"fp8 without a [bn, bk] weight_block_size (got {block!r})" if method == "fp8" else repr(method)
    raise PrequantizedError(
        f"{config_path}: quantization_config.quant_method {what} is not supported; porter "
        "converts bf16, MXFP8 (quant_method mxfp8), MXFP4 (quant_method mxfp4) and block-FP8 "
        "(quant_method fp8 with weight_block_size) checkpoints"
    )


def zeroed_scale_problem(values: torch.Tensor, scale: torch.Tensor) -> Optional[str]:
    """What is wrong with MXFP8 (values [..., K] e4m3, scale [..., K/32] UE8M0 bytes), or None: byte 255 is
    E8M0 NaN, and byte 0 (2^-127) only encodes an all-zero block (a zeroed scale would silently zero a
    block's weights). The one rule for a source `porter convert` reads and an artifact `porter verify`
    checks."""
    scale = scale.view(torch.uint8)
    nan = (scale == mxfp8.SCALE_NAN_BYTE).nonzero()
    if len(nan):
        return f"{len(nan)} scale byte(s) 255 (E8M0 NaN), first at {block_position(tuple(nan[0].tolist()))}"
    zero = scale == 0
    if not bool(zero.any()):
        return None
    vals = values.view(torch.uint8).reshape(*scale.shape, mxfp8.BLOCK)
    nonzero = (vals & 0x7F).amax(-1) > 0  # e4m3 magnitude bits (sign-only -0.0 counts as zero)
    bad = (zero & nonzero).nonzero()
    if not len(bad):
        return None
    return (
        f"{len(bad)} block(s) with scale byte 0 (2^-127) but non-zero values, first at "
        f"{block_position(tuple(bad[0].tolist()))} — a zeroed scale (only all-zero blocks get byte 0)"
    )


def block_position(idx: tuple) -> str:
    """A block position in words: expert/row/block for stacked experts, row/block otherwise."""
    return (
        f"expert {idx[0]}, row {idx[1]}, block {idx[2]}"
        if len(idx) == 3
        else ", ".join(f"{k} {v}" for k, v in zip(("row", "block"), idx[-2:]))
    )
