"""porter.json (the manifest) and the config.json `quantization_config` of a porter artifact.

Format layer (docs/architecture.md, docs/artifact-format.md): the architecture's own facts (its name, its
activation parameters) come from the converter through the plan (`plan.architecture_facts`), never from
here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from porter.errors import ManifestError
from porter.format import mxfp8
from porter.format.layout import ignored_layers
from porter.format.safe_files import read_json_object
from porter.format.safetensors_io import SHARD_METADATA, atomic_write_text, digest_rule, header_bytes, nbytes
from porter.version import __version__

MANIFEST = "porter.json"
FORMAT = "porter-mxfp8"
FORMAT_VERSION = 2  # 2: chunked digests (porter.format.safetensors_io.digest_rule); 1 had whole-file sha256s


@dataclass(frozen=True)
class Options:
    """porter.json's `options`: what the artifact was made with. The one place its fields and their
    defaults live; a record written by an older porter lacks some fields, and reads as these defaults."""

    quantize: str = "experts"  # experts | all | none
    gate_up: str = "auto"  # the row order of a fused source gate_up_proj: auto | interleaved | uninterleaved
    scale_rounding: str = "rceil"  # porter.format.mxfp8.ROUNDING_MODES
    max_shard_size: int = 5 * 10**9
    layout: str = "porter"  # porter | hf
    source_quantization: Optional[dict] = None  # a pre-quantized source's record (porter.format.prequantized)

    def record(self) -> dict:
        """The JSON object porter.json stores (source_quantization only for a pre-quantized source)."""
        rec = {f.name: getattr(self, f.name) for f in fields(self)}
        if rec["source_quantization"] is None:
            del rec["source_quantization"]
        return rec


def read_options(man: dict, where: str = MANIFEST) -> Options:
    """porter.json's options as an Options; a field of the wrong type is a ManifestError naming it."""
    rec = man.get("options", {}) if isinstance(man, dict) else None
    if rec is None:
        rec = {}
    if not isinstance(rec, dict):
        raise ManifestError(f"{where}: 'options' must be a JSON object; reconvert or restore this file")
    values = {}
    for f in fields(Options):
        if f.name not in rec:
            continue
        value, want = rec[f.name], type(f.default) if f.default is not None else dict
        if type(value) is not want:
            raise ManifestError(
                f"{where}: options.{f.name} is {value!r}, not a {want.__name__}; reconvert or restore this file"
            )
        values[f.name] = value
    return Options(**values)


def quantization_config(plan) -> dict:
    """Describes what was done, in the vendor `quant_method: mxfp8` vocabulary plus porter's layout facts."""
    q = plan.options.quantize
    ignored = ignored_layers(plan.tensors)
    return {
        "quant_method": "mxfp8" if q != "none" else "none",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, mxfp8.BLOCK],
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "scale_dtype": "uint8",
        "scale_rounding": plan.options.scale_rounding,
        "scope": q,
        "ignored_layers": ignored,
        "modules_to_not_convert": ignored,
        # porter's layout differs from the vendor release: experts are stacked per layer and scales are
        # named `*weight_scale`. Loaders other than porter's runtime need the vendor layout (`--layout hf`).
        "porter_layout": {
            "experts": "stacked w13_weight [E, 2I, H] ([gate; up]) + w2_weight [E, H, I]",
            "scale_suffix": "weight_scale",
            "gate_up_order": "gate_up",
        },
    }


def write(out: Path, plan, stats: dict, shard_digests: dict, before_rename=None) -> None:
    """porter.json, atomically (temp file + rename; `before_rename` runs in between).
    shard_digests: {file: {"header_sha256", "digest"}} (porter.format.safetensors_io.digest_rule).
    plan: the conversion plan — `source`, `config` (resolved, with `to_dict()` and `provenance`),
    `architecture_facts` ({"architecture": name, ...more top-level records}), `options`, `shards`, `digest`."""
    src, cfg = plan.source, plan.config
    facts = dict(plan.architecture_facts)
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "porter_version": __version__,
        "architecture": facts.pop("architecture"),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": {
            "repo_id": src.repo_id,
            "path": str(src.path.resolve()),
            "commit": src.commit,
            "files": [f.name for f in src.shard_files],
        },
        "options": plan.options.record(),
        "resolved_config": cfg.to_dict(),
        "provenance": cfg.provenance,
        **facts,
        "layout": {
            "gate_up_order": "gate_up",
            "source_gate_up": plan.options.gate_up,
            "block_size": mxfp8.BLOCK,
            "element_dtype": "float8_e4m3fn",
            "scale_dtype": "uint8",
            "scale_encoding": "ue8m0 byte b -> 2^(b-127); 0 for all-zero blocks",
            "scale_rounding": plan.options.scale_rounding,
            "scale_rule": (
                "smallest e with amax <= 448*2^e"
                if plan.options.scale_rounding == "rceil"
                else "floor(log2 amax) - 8 (OCP; clips)"
            ),
        },
        "digest": digest_rule(plan.digest),
        "shards": {
            f: {"tensors": len(es), "bytes": sum(e.nbytes for e in es) + _header_len(es), **shard_digests[f]}
            for f, es in plan.shards
        },
        "tensors": stats,
    }
    atomic_write_text(out / MANIFEST, json.dumps(doc, indent=1), before_rename=before_rename)


def _header_len(entries) -> int:
    return len(header_bytes(entries, SHARD_METADATA))  # the header the pipeline wrote


def record_bytes(rec) -> Optional[int]:
    """Bytes of a porter.json tensor record, by its dtype and shape; None when the record does not say them
    (a manifest integrity has not checked yet)."""
    if not isinstance(rec, dict):
        return None
    dtype, shape = getattr(torch, str(rec.get("dtype")), None), rec.get("shape")
    if (
        not isinstance(dtype, torch.dtype)
        or not isinstance(shape, list)
        or any(type(d) is not int for d in shape)
    ):
        return None
    return nbytes(dtype, shape)


def read(path: Path) -> dict:
    p = Path(path) / MANIFEST
    if not p.exists() and not p.is_symlink():
        raise ManifestError(f"{p}: missing; this is not a porter artifact (run `porter convert` first)")
    doc = read_json_object(p, ManifestError, "porter manifest")
    if doc.get("format") != FORMAT:
        raise ManifestError(f"{p}: format {doc.get('format')!r} is not {FORMAT!r}; not a porter artifact")
    return doc


def is_artifact(path: Path) -> bool:
    return (Path(path) / MANIFEST).exists()
