"""The plan of `porter convert`: every output tensor and shard, from the source's safetensors headers alone,
and its fingerprint (what a resume must match)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import converters
from converters.base import Converter, ResolvedConfig
from porter.commands.convert.options import ConvertOptions
from porter.errors import ConvertError
from porter.format import manifest, mxfp8
from porter.format.digest import DEFAULT_DIGEST
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


@dataclass
class Plan:
    source: Source
    converter: Converter  # resolved once, from source.raw_config's model_type
    config: ResolvedConfig  # resolved from source.raw_config by the converter
    architecture_facts: dict  # the converter's records for porter.json (its manifest_facts)
    tensors: list  # OutTensor in write order
    shards: list  # [(file name, [Entry, ...])]
    options: manifest.Options  # what the output is made with (porter.json's options)
    shard_of: dict = field(default_factory=dict)  # entry name -> file name
    digest: str = DEFAULT_DIGEST  # the chunk hash of the digest rule (porter.format.digest.CHUNK_HASHES)
    _source_digests: Optional[dict] = None
    _source_stats: Optional[dict] = None

    def _source_files(self) -> list[Path]:
        return [*self.source.shard_files, self.source.path / "config.json"]

    @property
    def source_digests(self) -> dict:
        """{file name: sample digest} of every source shard and config.json (computed once, at the start;
        with each file's stat identity, which source_change() compares against at the end)."""
        if self._source_digests is None:
            files = self._source_files()
            self._source_stats = {f.name: _identity(f) for f in files}
            self._source_digests = {f.name: source_sample_digest(f) if f.is_file() else None for f in files}
        return self._source_digests

    def source_change(self) -> Optional[str]:
        """'FILE was ...' for the first source file that is not what it was when the conversion started
        (deleted, replaced by another file, rewritten: its size, times or sampled bytes differ), else None."""
        before, stats = self.source_digests, self._source_stats
        for f in self._source_files():
            now = _identity(f)
            if now is None and stats[f.name] is not None:
                return f"{f} was deleted"
            if now is not None and stats[f.name] is not None and now[:2] != stats[f.name][:2]:
                return f"{f} was replaced by another file"
            if now != stats[f.name] or (now is not None and source_sample_digest(f) != before[f.name]):
                return f"{f} was rewritten"
        return None

    @property
    def output_bytes(self) -> int:
        return sum(e.nbytes for _, es in self.shards for e in es)


def _identity(path: Path) -> Optional[tuple]:
    """(device, inode, size, mtime, ctime) of a file (symlinks followed), None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def entries_for(t: OutTensor) -> list[Entry]:
    if not t.quantize:
        return [Entry(t.name, t.dtype, tuple(t.shape))]
    scale_shape = tuple(t.shape[:-1]) + (t.shape[-1] // mxfp8.BLOCK,)
    return [
        Entry(t.name, torch.float8_e4m3fn, tuple(t.shape)),
        Entry(t.scale, torch.uint8, scale_shape),
    ]


def make_plan(source: Source, options: Optional[ConvertOptions] = None, converter=None) -> Plan:
    """Every output tensor and shard of converting `source` with `options` (None: the defaults), from its
    headers alone. converter: the source's (converters.for_config), when the caller has resolved it."""
    options = (options or ConvertOptions()).check()
    where = str(source.path / "config.json")
    # the config's sizes checked against the source's tensors before anything is planned from them
    converter, config = converters.resolve(source.raw_config, source.meta, where, converter)
    pre = source.prequantized  # how its values were read and re-quantized: verify's rule too
    opts = options.artifact_options(converter.DEFAULT_SCOPE, None if pre is None else pre.record())
    if opts.layout == "hf":
        if converter.hf_layout is None:
            raise ConvertError(
                f"{where}: --layout hf: porter has no hf layout for architecture "
                f"{converter.ARCHITECTURE!r}; use --layout porter"
            )
        converter.hf_layout.check_hf_source(source.raw_config, where)
    tensors = converter.plan_tensors(config, source.meta, opts.quantize, opts.gate_up, opts.layout)
    for t in tensors:  # e.g. F8_E8M0 scale bytes in a source whose config declares no quantization
        if not t.quantize and t.dtype not in DTYPE_NAMES:
            name = t.sources[0] if t.sources else t.name
            raise ConvertError(
                f"{source.files.get(name) or source.path}: tensor {name!r} is {t.dtype}, "
                "which porter does not write; is config.json's quantization_config missing?"
            )
    groups, current, size = [], [], 0
    for e in (e for t in tensors for e in entries_for(t)):
        if current and size + e.nbytes > opts.max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        groups.append(current)
    n = len(groups)
    shards = [(f"model-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]
    facts = converter.manifest_facts(config)
    plan = Plan(source, converter, config, facts, tensors, shards, opts, digest=options.digest)
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
        "options": plan.options.record(),
        "commit": src.commit,
        "source_files": plan.source_digests,
        "shards": [(f, [(e.name, str(e.dtype), e.shape) for e in es]) for f, es in plan.shards],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()
