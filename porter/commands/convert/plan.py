"""The plan of `porter convert`: every output tensor and shard, from the source's safetensors headers alone,
and its fingerprint (what a resume must match)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

import converters
from converters.base import ResolvedConfig
from porter.errors import ConvertError
from porter.format import manifest, mxfp8
from porter.format.digest import CHUNK_HASHES, DEFAULT_DIGEST
from porter.format.layout import OutTensor
from porter.format.safetensors_io import (
    DTYPE_NAMES,
    Entry,
    digest_rule,
    source_sample_digest,
)
from porter.source import Source
from porter.version import __version__

COPY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
)


def parse_size(text, option: str = "--max-shard-size") -> int:
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(text).upper())
    if not m or float(m.group(1)) <= 0:
        raise ConvertError(f"{option} {text!r}: use a size like 5GB, 500MB or a byte count")
    unit = m.group(2) or "B"
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    size = int(float(m.group(1)) * scale)
    if size < 1:
        raise ConvertError(
            f"{option} {text!r} is less than one byte: use a size like 5GB, 500MB or a byte count"
        )
    return size


@dataclass
class Plan:
    source: Source
    config: ResolvedConfig  # resolved from source.raw_config by the converter
    architecture_facts: dict  # the converter's records for porter.json (its manifest_facts)
    tensors: list  # OutTensor in write order
    shards: list  # [(file name, [Entry, ...])]
    options: dict
    shard_of: dict = field(default_factory=dict)  # entry name -> file name
    digest: str = DEFAULT_DIGEST  # the chunk hash of the digest rule (porter.format.digest.CHUNK_HASHES)
    _source_digests: Optional[dict] = None

    @property
    def source_digests(self) -> dict:
        """{file name: sample digest} of every source shard and config.json (computed once)."""
        if self._source_digests is None:
            src = self.source
            files = [*src.shard_files, src.path / "config.json"]
            self._source_digests = {f.name: source_sample_digest(f) if f.is_file() else None for f in files}
        return self._source_digests

    @property
    def output_bytes(self) -> int:
        return sum(e.nbytes for _, es in self.shards for e in es)


def entries_for(t: OutTensor) -> list[Entry]:
    if not t.quantize:
        return [Entry(t.name, t.dtype, tuple(t.shape))]
    scale_shape = tuple(t.shape[:-1]) + (t.shape[-1] // mxfp8.BLOCK,)
    return [
        Entry(t.name, torch.float8_e4m3fn, tuple(t.shape)),
        Entry(t.scale, torch.uint8, scale_shape),
    ]


def make_plan(
    source: Source,
    quantize="experts",
    gate_up="auto",
    scale_rounding="rceil",
    max_shard_size="5GB",
    layout="porter",
    digest=DEFAULT_DIGEST,
) -> Plan:
    if scale_rounding not in mxfp8.ROUNDING_MODES:
        raise ConvertError(f"--scale-rounding must be one of {mxfp8.ROUNDING_MODES}")
    if digest not in CHUNK_HASHES:
        raise ConvertError(f"--digest {digest!r}: give one of {', '.join(CHUNK_HASHES)}")
    converter = converters.for_config(source.raw_config, str(source.path / "config.json"))
    config = converter.resolve_config(source.raw_config)
    if layout == "hf":
        if converter.hf_layout is None:
            raise ConvertError(
                f"{source.path / 'config.json'}: --layout hf: porter has no hf layout for architecture "
                f"{converter.ARCHITECTURE!r}; use --layout porter"
            )
        converter.hf_layout.check_hf_source(source.raw_config, str(source.path / "config.json"))
    tensors = converter.plan_tensors(config, source.meta, quantize, gate_up, layout)
    for t in tensors:  # e.g. F8_E8M0 scale bytes in a source whose config declares no quantization
        if not t.quantize and t.dtype not in DTYPE_NAMES:
            name = t.sources[0] if t.sources else t.name
            raise ConvertError(
                f"{source.files.get(name) or source.path}: tensor {name!r} is {t.dtype}, "
                "which porter does not write; is config.json's quantization_config missing?"
            )
    cap = parse_size(max_shard_size)
    groups, current, size = [], [], 0
    for e in (e for t in tensors for e in entries_for(t)):
        if current and size + e.nbytes > cap:
            groups.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        groups.append(current)
    n = len(groups)
    shards = [(f"model-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]
    options = {
        "quantize": quantize,
        "gate_up": gate_up,
        "scale_rounding": scale_rounding,
        "max_shard_size": cap,
        "layout": layout,
    }
    if source.prequantized is not None:  # how its values were read and re-quantized: verify's rule too
        options["source_quantization"] = source.prequantized.record()
    plan = Plan(source, config, converter.manifest_facts(config), tensors, shards, options, digest=digest)
    plan.shard_of = {e.name: f for f, es in shards for e in es}
    return plan


def fingerprint(plan: Plan) -> str:
    """Identifies a conversion: porter version, options, the source's bytes (every shard's header and sampled
    data, config.json: Plan.source_digests) and the full output plan."""
    src = plan.source
    ident = {
        "porter": __version__,
        "format_version": manifest.FORMAT_VERSION,
        "digest": digest_rule(plan.digest),
        "options": plan.options,
        "commit": src.commit,
        "source_files": plan.source_digests,
        "shards": [(f, [(e.name, str(e.dtype), e.shape) for e in es]) for f, es in plan.shards],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------
