"""safetensors files without the safetensors library: validated headers, pread/pwrite at known offsets.

Reading: `parse_header` checks a header against its file (every malformed file is named), `TensorReader`
reads tensors with pread from any thread (no mmap: file pages never count as the process's RSS).
Writing: the output header is known up front from the plan, so every tensor's byte range in its shard
is known and tensors can be written out of order with pwrite (porter.commands.convert). Shards are written as
`<name>.partial` and renamed only when complete, so a crash never leaves a file that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import unicodedata
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from porter.errors import MalformedSafetensors, OutputFolderError
from porter.format.digest import CHUNK_HASH_DOC, CHUNK_HASHES, DEFAULT_DIGEST
from porter.format.safe_files import atomic_write, regular_file

DTYPE_NAMES = {  # torch dtype -> safetensors header dtype
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
# safetensors header dtype -> torch dtype (read side; E8M0 scale bytes are reinterpreted as uint8 on read)
ST_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()} | {
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8)
}


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


SHARD_METADATA = {"format": "pt"}  # the __metadata__ of every shard porter writes


def header_bytes(entries: list[Entry], metadata: dict | None = None) -> bytes:
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for e in entries:
        header[e.name] = {
            "dtype": DTYPE_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def parse_header(path: Path) -> tuple[int, dict]:
    """(data start offset, header dict without `__metadata__`) of a safetensors file, validated against
    the file size: every tensor has a known dtype, a shape of non-negative ints and data_offsets whose
    length is the shape's byte count, the tensors tile the data region exactly (no gap, no overlap) and
    the region ends where the file ends. Raises MalformedSafetensors naming the file."""
    path = Path(path)
    redo = "re-download or re-create this shard"
    size = regular_file(path, MalformedSafetensors, "safetensors shard").stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise MalformedSafetensors(f"{path}: not a safetensors file ({size} bytes, no header); {redo}")
        n = int.from_bytes(raw, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise MalformedSafetensors(
                f"{path}: header length {n} does not fit the file ({size} bytes): "
                f"truncated or not a safetensors file; {redo}"
            )
        text = f.read(n)
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise MalformedSafetensors(
            f"{path}: corrupt safetensors header (invalid JSON: {e}); {redo}"
        ) from None
    if not isinstance(header, dict):
        raise MalformedSafetensors(f"{path}: corrupt safetensors header (not a JSON object); {redo}")
    _check_metadata(path, header.pop("__metadata__", None), redo)
    spans = []
    for name, info in header.items():
        spans.append((*_entry_span(path, name, info, redo), name))
    data_len, at = size - 8 - n, 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = "overlaps the previous tensor" if begin < at else f"leaves a gap of {begin - at} bytes"
            raise MalformedSafetensors(
                f"{path}: tensor {name!r} data_offsets [{begin}, {end}] {what}; {redo}"
            )
        at = end
    if at != data_len:
        raise MalformedSafetensors(
            f"{path}: header describes {at} bytes of tensor data but the file holds "
            f"{data_len} (truncated or padded); {redo}"
        )
    return 8 + n, header


def _check_metadata(path, metadata, redo) -> None:
    """The safetensors format's `__metadata__` is a map of strings to strings (the safetensors library refuses
    anything else when it opens the file)."""
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise MalformedSafetensors(
            f"{path}: __metadata__ is {type(metadata).__name__}, not a map of strings; {redo}"
        )
    for k, v in metadata.items():
        if not isinstance(v, str):
            raise MalformedSafetensors(
                f"{path}: __metadata__[{k!r}] is {type(v).__name__} {v!r:.40}, not a string; {redo}"
            )


SCALE_NAME_SUFFIXES = ("_scale_inv", "_scale")  # where an F8_E8M0 tensor may appear: MXFP8 scale bytes


def _entry_span(path, name, info, redo) -> tuple[int, int]:
    bad = lambda why: MalformedSafetensors(f"{path}: tensor {name!r}: {why}; {redo}")  # noqa: E731
    control = next((c for c in name if unicodedata.category(c) == "Cc"), None)
    if control is not None:  # names go into one-line messages, porter.json and the index
        raise MalformedSafetensors(
            f"{path}: tensor {name!r} has a control character ({control!r}) in its "
            "name; rename the tensor in the source"
        )
    if not isinstance(info, dict):
        raise bad("header entry is not an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise MalformedSafetensors(
            f"{path}: tensor {name!r} has unsupported dtype {dtype!r} "
            f"(porter reads {', '.join(sorted(ST_DTYPES))})"
        )
    if dtype == "F8_E8M0" and not name.endswith(SCALE_NAME_SUFFIXES):  # porter writes scale bytes as U8 and
        # carries no E8M0 values: neither its writer nor the engines have an E8M0 weight
        raise MalformedSafetensors(
            f"{path}: tensor {name!r} is F8_E8M0 but not an MXFP8 scale (a name "
            f"ending in {' or '.join(SCALE_NAME_SUFFIXES)}); porter reads E8M0 only "
            "as scale bytes"
        )
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end")
    want = nbytes(ST_DTYPES[dtype], shape)
    if offsets[1] - offsets[0] != want:
        raise bad(
            f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype} {shape} needs {want}"
        )
    return offsets[0], offsets[1]


def pread_into(fd: int, buf: memoryview, offset: int, path) -> None:
    """Fill buf from the file at offset (os.preadv releases the GIL; no mmap, so no file-backed RSS)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise MalformedSafetensors(
                f"{path}: file ends at byte {offset + got}, inside tensor data: "
                "truncated; re-download or re-create this shard"
            )
        got += n


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


class TensorReader:
    """Reads source tensors (or one row along dim 0) with pread into fresh tensors, from any thread.

    spans: tensor name -> (file path, absolute data offset, dtype, shape), from parse_header (porter.source
    builds them as it reads the headers: Source.spans). `pin` allocates page-locked buffers (for asynchronous
    host->device copies)."""

    def __init__(self, spans: dict):
        self.spans = spans
        self._fds: dict = {}

    def nbytes(self, name: str, index: Optional[int] = None) -> int:
        _, _, dtype, shape = self.spans[name]
        return nbytes(dtype, shape if index is None else shape[1:])

    def read(
        self, name: str, index: Optional[int] = None, pin: bool = False, into: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """into: a uint8 buffer of exactly nbytes(name, index) to read into (e.g. a reused pinned slab)."""
        path, offset, dtype, shape = self.spans[name]
        if dtype == ST_DTYPES["F8_E8M0"]:
            dtype = torch.uint8  # E8M0 scale bytes: reinterpret, never value-convert
        if index is not None:
            if not 0 <= index < shape[0]:
                raise IndexError(f"{name}: row {index} of {shape[0]}")
            offset += index * nbytes(dtype, shape[1:])
            shape = shape[1:]
        out = (
            torch.empty(shape, dtype=dtype, pin_memory=pin) if into is None else into.view(dtype).view(shape)
        )
        if out.numel():
            pread_into(self._fd(path), memoryview(out.reshape(-1).view(torch.uint8).numpy()), offset, path)
        return out

    def read_bytes(
        self, name: str, begin: int, length: int, pin: bool = False, into: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """`length` raw bytes of a tensor's data from byte `begin` (a verbatim copy, chunk by chunk).
        into: a uint8 buffer of exactly `length` bytes to read into."""
        path, offset, _, _ = self.spans[name]
        out = torch.empty(length, dtype=torch.uint8, pin_memory=pin) if into is None else into
        pread_into(self._fd(path), memoryview(out.numpy()), offset + begin, path)
        return out

    def _fd(self, path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds.setdefault(path, _open_source_file(path))
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _open_source_file(path) -> int:
    """A read descriptor of a source shard that was a regular file when the plan was made; gone or turned
    into something else since (deleted, replaced by a FIFO mid-run) is one line naming it, never a hang."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise MalformedSafetensors(
            f"{path}: cannot be read ({e.strerror}); it changed or went away during the conversion: restore "
            "the source, then convert again"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MalformedSafetensors(
            f"{path}: no longer a regular file (replaced during the conversion); restore the source, then "
            "convert again"
        )
    return fd


def atomic_write_text(path: Path, text: str, before_rename=None) -> None:
    """Write a small file so that it is either absent/old or complete: a new temp file (never through a
    link planted at its name), fsync, rename (porter.format.safe_files.atomic_write)."""
    atomic_write(path, text.encode("utf-8"), OutputFolderError, before_rename)


# ---------------------------------------------------------------------------------------------------
# chunked digests (docs/artifact-format.md, "Digests"): every chunk of a tensor's data is hashed on its own,
# so a shard of any size is hashed by all cores at once, by the converter and by `porter verify` alike.

DIGEST_CHUNK_BYTES = 16 << 20  # what porter writes; a reader follows the chunk_bytes a manifest records


def digest_rule(chunk_hash: str = DEFAULT_DIGEST) -> dict:
    """The digest rule, as porter.json records it."""
    return {
        "algorithm": f"{chunk_hash}-chunked",
        "chunk_bytes": DIGEST_CHUNK_BYTES,
        "tensor": f"sha256 of the concatenated {CHUNK_HASH_DOC[chunk_hash]} of its data bytes' chunks "
        "[i*chunk_bytes, (i+1)*chunk_bytes), the last one shorter; a 0-byte tensor has no chunks",
        "shard": "sha256 of the 32-byte sha256 of its header bytes [0, 8 + header length) followed by each "
        "tensor's 32-byte digest in the order the header lists them",
    }


def chunk_hash_of(rule) -> Optional[str]:
    """The chunk hash a manifest's digest rule names ("xxh3-128-chunked" -> "xxh3-128"), or None."""
    algorithm = rule.get("algorithm") if isinstance(rule, dict) else None
    name = (
        algorithm.removesuffix("-chunked")
        if isinstance(algorithm, str) and algorithm.endswith("-chunked")
        else None
    )
    return name if name in CHUNK_HASHES else None


def chunk_spans(length: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(begin, length) of each digest chunk of `length` data bytes."""
    return [(b, min(chunk_bytes, length - b)) for b in range(0, length, chunk_bytes)]


def tensor_digest(chunk_digests: list) -> str:
    """A tensor's digest (hex) from its chunks' digests (bytes), in order."""
    return hashlib.sha256(b"".join(chunk_digests)).hexdigest()


def shard_digest(header_sha256: str, tensor_digests: list) -> str:
    """A shard's digest (hex) from its header's sha256 and its tensors' digests (hex) in header order."""
    return hashlib.sha256(
        bytes.fromhex(header_sha256) + b"".join(bytes.fromhex(d) for d in tensor_digests)
    ).hexdigest()


_CHUNK_BUF = threading.local()  # per thread: a reusable buffer for reading a chunk


def read_chunk_digest(fd: int, offset: int, length: int, path, h) -> bytes:
    """The digest of `length` bytes of an open file from `offset`, read into this thread's buffer, fed to
    h (a new chunk hasher, or one that has taken the bytes before `offset`). Both hashes release the GIL."""
    buf = getattr(_CHUNK_BUF, "buf", None)
    if buf is None or len(buf) < length:
        buf = _CHUNK_BUF.buf = memoryview(bytearray(max(length, DIGEST_CHUNK_BYTES)))
    pread_into(fd, buf[:length], offset, path)
    h.update(buf[:length])
    return h.digest()


@dataclass
class FileDigests:
    header: dict  # parse_header's (validated, without __metadata__)
    header_sha256: str
    tensors: dict  # name -> digest (hex)
    digest: str  # the shard's


def file_digests(
    path: Path, pool, chunk_bytes: Optional[int] = None, chunk_hash: str = DEFAULT_DIGEST
) -> FileDigests:
    """The digests of a safetensors file (validated by parse_header), its chunks hashed on `pool`'s threads
    (a concurrent.futures executor). chunk_bytes, chunk_hash: the manifest's rule (default: what porter
    writes now). Raises MalformedSafetensors for a file that is not one."""
    path, chunk_bytes, new_hash = Path(path), chunk_bytes or DIGEST_CHUNK_BYTES, CHUNK_HASHES[chunk_hash]
    start, header = parse_header(path)
    fd, jobs = os.open(path, os.O_RDONLY), {}
    try:
        head = bytearray(start)
        pread_into(fd, memoryview(head), 0, path)
        names = list(header)  # header order (json keeps it): the order of the shard digest
        for n in names:
            at, size = (
                start + header[n]["data_offsets"][0],
                nbytes(ST_DTYPES[header[n]["dtype"]], header[n]["shape"]),
            )
            jobs[n] = [
                pool.submit(read_chunk_digest, fd, at + b, k, path, new_hash())
                for b, k in chunk_spans(size, chunk_bytes)
            ]
        tensors = {n: tensor_digest([f.result() for f in fs]) for n, fs in jobs.items()}
    finally:  # nothing may read fd after it is closed
        futures.wait([f for fs in jobs.values() for f in fs if not f.cancel()])
        os.close(fd)
    head_sha = hashlib.sha256(head).hexdigest()
    return FileDigests(header, head_sha, tensors, shard_digest(head_sha, [tensors[n] for n in names]))


# ---------------------------------------------------------------------------------------------------
# source fingerprints (docs/convert.md, "Crash safety"): what `--resume` proves about a source file without
# reading all of it. The header fixes every tensor's name, dtype, shape and place; the samples catch data
# rewritten in place at the same size (a re-download of another revision, an edited shard).

SAMPLE_EDGE_BYTES = 64 << 10  # the first and the last 64 KiB of the data region
SAMPLE_WINDOWS, SAMPLE_WINDOW_BYTES = 8, 4 << 10  # 4 KiB at 8 evenly spaced offsets in between


def sample_spans(size: int, data_start: int) -> list[tuple[int, int]]:
    """(begin, length) of the bytes `source_sample_digest` reads from a file of `size` bytes."""
    data_len = max(0, size - data_start)
    spans = [
        (0, min(size, data_start)),
        (data_start, min(SAMPLE_EDGE_BYTES, data_len)),
        (max(data_start, size - SAMPLE_EDGE_BYTES), min(SAMPLE_EDGE_BYTES, data_len)),
    ]
    spans += [
        (data_start + data_len * k // (SAMPLE_WINDOWS + 1), min(SAMPLE_WINDOW_BYTES, data_len))
        for k in range(1, SAMPLE_WINDOWS + 1)
    ]
    return [(b, min(n, size - b)) for b, n in spans]


def source_sample_digest(path: Path) -> str:
    """sha256 over a source file's size, its whole header (8-byte length + JSON) and sampled data bytes
    (`sample_spans`). A file that is not safetensors (config.json, a header length past the end) is hashed
    whole up to MAX_HEADER_BYTES, then sampled the same way."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8).ljust(8, b"\0"), "little")
        start = 8 + n if 8 + n <= min(size, MAX_HEADER_BYTES) else min(size, MAX_HEADER_BYTES)
        for begin, length in sample_spans(size, start):
            f.seek(begin)
            h.update(f.read(length))
    return h.hexdigest()
