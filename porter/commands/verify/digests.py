"""Integrity's data check, on the bytes exact bytes reads anyway: every artifact tensor's digest against
porter.json's (porter.format.safetensors_io.digest_rule), so verify reads the artifact once for steps 1
and 2 (docs/verify.md, "Integrity").

The exact pass reads each tensor whole or expert by expert ([E, N, K]: expert e is the bytes
[e * N*K, (e+1) * N*K) of the tensor), on several threads at once; `add` hashes every digest chunk that
lies whole in the bytes handed to it, and keeps the pieces of a chunk that spans two reads until all of
them are in (at most one chunk per read boundary). A staged read (runtime.staging) hashes as it reads and
hands its tensor digests to `staged`. `finish` hashes what was not read (a tensor without a source, an
expert never compared) from the shards and names every tensor whose digest differs, in integrity's words; the
shards found whole are recorded for runtime.load, which then need not hash them (porter.format.checked).
"""

from __future__ import annotations

import os
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from porter.commands.verify.integrity import changed_tensors
from porter.commands.verify.verdict import Failure
from porter.cores import available_cores
from porter.errors import PorterError
from porter.format import manifest
from porter.format.checked import CheckedShards
from porter.format.digest import CHUNK_HASHES
from porter.format.safetensors_io import (
    chunk_spans,
    parse_header,
    read_chunk_digest,
    shard_digest,
    tensor_digest,
)


class TensorDigests:
    """The digests of the artifact's tensors, gathered from the reads of the exact pass. man: porter.json;
    chunk_bytes, chunk_hash: its digest rule (integrity.digest_rule)."""

    def __init__(self, art: Path, man: dict, chunk_bytes: int, chunk_hash: str):
        self.art, self.chunk_bytes, self.new_hash = Path(art), chunk_bytes, CHUNK_HASHES[chunk_hash]
        self.chunk_hash = chunk_hash
        self.tensors, self.shards = man.get("tensors", {}), man.get("shards", {})
        self.got: dict = {}  # name -> tensor digest (hex), once every chunk is in
        self._chunks: dict = {}  # name -> {chunk index: digest (bytes)}
        self._pieces: dict = {}  # (name, chunk index) -> {offset in the chunk: bytes}
        self._lock = threading.Lock()
        # what this pass finds equal to porter.json is recorded for runtime.load (porter.format.checked): the
        # shards' identities now, before any byte is read
        self.checked = CheckedShards(self.art, rehash=True)
        self.before = self.checked.snapshot(self.art / f for f in self.shards)

    def add(self, name: str, begin: int, data: memoryview) -> None:
        """Bytes [begin, begin + len(data)) of tensor `name`'s data, as the exact pass read them."""
        if name in self.got or name not in self.tensors:
            return
        size, c = self._size(name), self.chunk_bytes
        end = begin + len(data)
        done = {}
        for k in range(begin // c, -(-end // c)):
            lo, hi = k * c, min((k + 1) * c, size)
            a, b = max(lo, begin), min(hi, end)
            if (a, b) == (lo, hi):
                done[k] = self._hash(data[a - begin : b - begin])
            else:  # the chunk continues in another read: kept until its other pieces are in
                whole = self._piece(name, k, a - lo, bytes(data[a - begin : b - begin]), hi - lo)
                if whole is not None:
                    done[k] = self._hash(whole)
        self._record(name, done)

    def staged(self, name: str, digest: str) -> None:
        """A tensor's digest, computed by the staged reader as it read it (runtime.staging)."""
        with self._lock:
            self.got.setdefault(name, digest)

    def changed(self, names) -> list:
        """Those of `names` (and their scales) read whole so far whose digest differs from porter.json's."""
        names = {x for n in names for x in (n, self.tensors.get(n, {}).get("scale")) if x}
        with self._lock:
            return sorted(n for n in names if n in self.got and self.got[n] != self.tensors[n].get("digest"))

    def finish(self) -> list[Failure]:
        """Hash every tensor not read whole (from its shard, chunks on every core); the failures, in
        integrity's words: each changed tensor, or a shard whose digest porter.json records differently."""
        out, whole = [], {}
        with ThreadPoolExecutor(available_cores(), thread_name_prefix="porter-digest") as pool:
            for f, rec in self.shards.items():
                try:
                    start, header = parse_header(self.art / f)
                    self._hash_rest(self.art / f, start, header, pool)
                except (PorterError, OSError) as e:  # changed since integrity read it, or unreadable
                    out.append(Failure("integrity", f"shard {f}: {e}", shard=f))
                    continue
                failed = self._judge(f, rec, list(header))
                if not failed:
                    whole[self.art / f] = list(header)
                out += failed
        self.checked.record(self.before, whole)
        return out

    # -- helpers ----------------------------------------------------------------------------------------
    def _size(self, name: str) -> int:
        return manifest.record_bytes(self.tensors[name])  # the header's dtype and shape (integrity checked)

    def _hash(self, data) -> bytes:
        h = self.new_hash()
        h.update(data)
        return h.digest()

    def _piece(self, name: str, k: int, at: int, data: bytes, length: int):
        """Keep a piece of chunk k; the chunk's bytes once all its pieces are in, else None."""
        with self._lock:
            pieces = self._pieces.setdefault((name, k), {})
            pieces[at] = data
            if sum(len(p) for p in pieces.values()) < length:
                return None
            del self._pieces[(name, k)]
        return b"".join(pieces[a] for a in sorted(pieces))

    def _record(self, name: str, done: dict) -> None:
        n = -(-self._size(name) // self.chunk_bytes)
        with self._lock:
            chunks = self._chunks.setdefault(name, {})
            chunks.update(done)
            if len(chunks) == n and name not in self.got:
                self.got[name] = tensor_digest([chunks[k] for k in range(n)])
                del self._chunks[name]

    def _hash_rest(self, path: Path, start: int, header: dict, pool) -> None:
        rest = [n for n in header if n not in self.got]
        if not rest:
            return
        fd, jobs = os.open(path, os.O_RDONLY), {}
        try:
            for n in rest:
                b0, b1 = header[n]["data_offsets"]
                jobs[n] = [
                    pool.submit(read_chunk_digest, fd, start + b0 + b, k, path, self.new_hash())
                    for b, k in chunk_spans(b1 - b0, self.chunk_bytes)
                ]
            for n, fs in jobs.items():
                self.got[n] = tensor_digest([x.result() for x in fs])
        finally:  # nothing may read fd after it is closed
            futures.wait([x for fs in jobs.values() for x in fs if not x.cancel()])
            os.close(fd)

    def _judge(self, f: str, rec: dict, order: list) -> list[Failure]:
        out = changed_tensors(f, self.got, order, self.tensors)
        # every tensor and the header (integrity checked it) are porter.json's: so must the shard's digest be
        digest = shard_digest(str(rec.get("header_sha256")), [self.got[n] for n in order])
        if not out and digest != rec.get("digest"):
            out.append(
                Failure(
                    "integrity",
                    f"shard {f}: digest {digest[:12]}… differs from porter.json {str(rec.get('digest'))[:12]}…",
                    shard=f,
                )
            )
        return out
