"""Streaming safetensors writing: the header is known up front (from the plan), tensors are appended
one at a time in plan order, and sha256 of every tensor and of the whole file are computed on the fly.

A shard is written as `<name>.partial` and renamed only when complete, so a crash never leaves a file
that looks finished.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

DTYPE_NAMES = {  # torch dtype -> safetensors header dtype
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8", torch.int8: "I8",
    torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
}
# safetensors header dtype -> torch dtype (read side; E8M0 scale bytes are reinterpreted as uint8 on read)
ST_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()} | \
    {"F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8)}


def nbytes(dtype: torch.dtype, shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """torch's own spelling without the module ("bfloat16"), as porter.json records dtypes."""
    return str(dtype).removeprefix("torch.")


@dataclass
class Entry:
    name: str
    dtype: torch.dtype
    shape: tuple

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def header_bytes(entries: list[Entry], metadata: dict | None = None) -> bytes:
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for e in entries:
        header[e.name] = {"dtype": DTYPE_NAMES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


class ShardWriter:
    def __init__(self, path: Path, entries: list[Entry], metadata: dict | None = None):
        self.path, self.entries = Path(path), entries
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._next = 0
        self._written = 0  # bytes of the current entry written so far
        self._tensor_hash = None
        self._file_hash = hashlib.sha256()
        self.tensor_sha256: dict = {}
        self._f = open(self.partial, "wb")
        self._emit(header_bytes(entries, metadata))

    def _emit(self, data) -> None:
        self._f.write(data)
        self._file_hash.update(data)

    def write(self, name: str, t: torch.Tensor) -> Optional[Entry]:
        """Append the next tensor whole, or a leading chunk of it (rows along dim 0, in order).
        Returns the tensor's Entry once it is complete, None while chunks are still due."""
        if self._next >= len(self.entries):
            raise RuntimeError(f"{self.path.name}: all {len(self.entries)} tensors already written, got {name!r}")
        e = self.entries[self._next]
        if name != e.name:
            raise RuntimeError(f"{self.path.name}: expected tensor {e.name!r} next, got {name!r}")
        # a chunk is whole rows: its trailing dims equal the entry's (bytes are counted below)
        trailing = tuple(t.shape[1:]) == tuple(e.shape[len(e.shape) - t.ndim + 1:]) if 0 < t.ndim <= len(e.shape) \
            else tuple(t.shape) == tuple(e.shape)
        if t.dtype != e.dtype or not trailing:
            raise RuntimeError(f"{name}: planned {e.dtype} {tuple(e.shape)}, produced {t.dtype} {tuple(t.shape)}")
        data = tensor_bytes(t)
        if self._tensor_hash is None:
            self._tensor_hash = hashlib.sha256()
        self._tensor_hash.update(data)
        self._emit(data)
        self._written += len(data)
        if self._written > e.nbytes:
            raise RuntimeError(f"{name}: produced more bytes than planned ({self._written} > {e.nbytes})")
        if self._written < e.nbytes:
            return None
        self.tensor_sha256[name] = self._tensor_hash.hexdigest()
        self._tensor_hash, self._written = None, 0
        self._next += 1
        return e

    @property
    def done(self) -> bool:
        return self._next == len(self.entries)

    def close(self) -> str:
        """Finish the shard (fsync + rename) and return its sha256."""
        if not self.done:
            raise RuntimeError(f"{self.path.name}: closed after {self._next} of {len(self.entries)} tensors")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.partial, self.path)
        return self._file_hash.hexdigest()

    def abort(self) -> None:
        self._f.close()


def file_sha256(path: Path) -> str:
    return range_sha256(path, 0, Path(path).stat().st_size)


def range_sha256(path: Path, offset: int, length: int, chunk: int = 1 << 24) -> str:
    """sha256 of `length` bytes of a file from `offset` (a tensor's data: porter.source.tensor_span)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0 and (block := f.read(min(length, chunk))):
            h.update(block)
            length -= len(block)
    return h.hexdigest()
