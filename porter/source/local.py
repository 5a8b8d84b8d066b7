"""Read a local checkpoint folder: safetensors only, lazily.

Source layer (docs/architecture.md): this module knows safetensors and Hugging Face checkpoint folders,
not any architecture. It hands its caller the raw config.json and every tensor's dtype and shape from the
shard headers; resolving that config is the architecture's job (its converter: converters.for_config).
Never unpickles: a checkpoint that has only `*.bin` / `*.pt` weights is refused.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from porter.errors import SourceError
from porter.format import prequantized
from porter.format.safe_files import inside, read_json, regular_file
from porter.format.safetensors_io import ST_DTYPES, nbytes, parse_header

log = logging.getLogger("porter")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
INDEX_NAME = "model.safetensors.index.json"


@dataclass
class Source:
    """A checkpoint folder: its raw config.json (unresolved), tensor metadata from the shard headers, and
    lazy reads. The caller resolves `raw_config` with its architecture's rules."""

    path: Path
    raw_config: dict
    meta: dict  # tensor name -> (torch dtype, shape tuple)
    files: dict  # tensor name -> shard Path
    repo_id: Optional[str] = None
    commit: Optional[str] = None
    # a pre-quantized source (porter.format.prequantized.Scheme): its quantized weights are listed in `meta`
    # as bfloat16 and dequantized by read(); their scale tensors are not listed
    prequantized: Optional[object] = None
    # tensor name -> (shard Path, absolute data offset, stored dtype, shape) for every stored tensor (scales
    # included), from the headers open_local parsed; empty for headers fetched without the shards
    spans: dict = field(default_factory=dict, repr=False)
    _handles: dict = field(default_factory=dict, repr=False)

    def read(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        """One tensor (or its [index] slice along dim 0, read alone) from its shard."""
        if self.prequantized is not None and name in self.prequantized.scales:
            scale = self._read_stored(self.prequantized.scales[name], index)
            return self.prequantized.dequantize(
                self._read_stored(name, index),
                scale,
                f"{self.files[name]}: tensor {name!r}" + ("" if index is None else f"[{index}]"),
            )
        return self._read_stored(name, index)

    def _read_stored(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        f = self.files[name]
        h = self._handles.get(f)  # one lookup: a close() from another thread between two would KeyError
        if h is None:
            h = self._handles.setdefault(f, safe_open(str(f), framework="pt"))
        t = h.get_tensor(name) if index is None else h.get_slice(name)[index]
        if t.dtype == ST_DTYPES["F8_E8M0"] and t.dtype != torch.uint8:
            t = t.view(torch.uint8)  # E8M0 scale bytes: reinterpret, never value-convert
        return t

    def close(self) -> None:
        """Drop the safe_open handles (each maps a whole shard); tensors still referenced keep theirs."""
        self._handles.clear()

    def nbytes(self, name: str) -> int:
        return nbytes(*self.meta[name])

    @property
    def stored_meta(self) -> dict:
        """`meta` without the pre-quantized weights: the tensors whose stored bytes are what read() returns
        (only these may be copied byte for byte)."""
        scales = self.prequantized.scales if self.prequantized is not None else {}
        return {n: m for n, m in self.meta.items() if n not in scales}

    @property
    def shard_files(self) -> list[Path]:
        return sorted(set(self.files.values()))

    @property
    def total_bytes(self) -> int:
        return sum(nbytes(d, s) for d, s in self.meta.values())


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (no tensor data read), validated against the file size: a
    truncated file, broken JSON, offsets that disagree with the file or an unknown dtype is an error naming
    the file (porter.format.safetensors_io.parse_header)."""
    return parse_header(path)[1]


def tensor_span(path: Path, info: dict) -> tuple[int, int]:
    """(absolute byte offset, byte length) of a tensor's data from its header entry `info`."""
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    begin, end = info["data_offsets"]
    return data_start + begin, end - begin


def load_json(path: Path):
    if not os.path.lexists(path):
        raise SourceError(f"{path}: missing; a checkpoint needs config.json beside its shards")
    return read_json(path, SourceError)


def weight_files(path: Path) -> list[Path]:
    """The safetensors shards of a checkpoint dir (from the index when present); refuses pickles."""
    index = path / INDEX_NAME
    if index.exists() or index.is_symlink():
        doc = load_json(index)
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SourceError(
                f"{index}: no weight_map object (tensor name -> shard file); re-download the index"
            )
        bad = [
            (k, f)
            for k, f in weight_map.items()
            if not isinstance(f, str) or not f.endswith(".safetensors") or Path(f).name != f
        ]
        if bad:
            raise SourceError(
                f"{index}: weight_map[{bad[0][0]!r}] = {bad[0][1]!r} is not a .safetensors file name "
                "in this folder; re-download the index"
            )
        files = sorted({inside(path, f, SourceError, INDEX_NAME) for f in weight_map.values()})
        missing = [f for f in files if not os.path.lexists(f)]
        if missing:
            raise SourceError(f"{missing[0]}: listed in {INDEX_NAME} but missing; re-download the checkpoint")
        return [regular_file(f, SourceError, "shard") for f in files]
    files = [
        regular_file(inside(path, f.name, SourceError), SourceError, "shard")
        for f in sorted(path.glob("*.safetensors"))
    ]
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise SourceError(
            f"{path}: only pickle weights ({', '.join(pickles[:3])}); porter never unpickles. "
            "Convert them to safetensors with a trusted tool first"
        )
    raise SourceError(f"{path}: no *.safetensors weights found")


def open_local(
    path: Path, repo_id: Optional[str] = None, commit: Optional[str] = None, headers: Optional[dict] = None
) -> Source:
    """A checkpoint dir: raw config.json and the tensors its safetensors headers list (nothing resolved,
    no tensor data read). `headers` ({file: safetensors header}) stands in for shards not present locally
    (a --dry-run of a hub repo reads headers only)."""
    path = Path(path)
    if not path.is_dir():
        raise SourceError(f"{path}: not a directory (give a checkpoint dir or a Hugging Face repo id)")
    raw = load_json(path / "config.json")
    if not isinstance(raw, dict):
        raise SourceError(f"{path / 'config.json'}: must hold a JSON object")
    scheme = prequantized.detect(raw, path / "config.json")  # None, or MXFP8 / block-FP8; else refused
    meta, files, spans = {}, {}, {}
    shards = {path / f: h for f, h in headers.items()} if headers else {f: None for f in weight_files(path)}
    for f, header in shards.items():
        start = None
        if header is None:  # each shard's header is parsed here once; readers use `spans`
            start, header = parse_header(f)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info.get("dtype") not in ST_DTYPES:
                raise SourceError(f"{f}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
            if name in meta:
                raise SourceError(f"{f}: tensor {name!r} also appears in {files[name]}")
            meta[name] = (ST_DTYPES[info["dtype"]], tuple(info["shape"]))
            files[name] = f
            if start is not None:
                spans[name] = (f, start + info["data_offsets"][0], *meta[name])
    if scheme is not None:
        meta = scheme.adopt(meta, str(path))
        log.info("source is pre-quantized: %s; dequantized tensor by tensor", scheme.describe())
    return Source(path, raw, meta, files, repo_id=repo_id, commit=commit, prequantized=scheme, spans=spans)
