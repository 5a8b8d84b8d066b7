"""Shard output: every shard's header is fixed by the plan, so workers pwrite their results into known byte
ranges in any order; each tensor's digest is handed its ranges as they land, and a shard is renamed from
`.partial` and journaled once every digest and error record is in."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from porter.engine.digests import TensorDigest
from porter.engine.faults import fault_point
from porter.engine.sysio import start_writeback
from porter.engine.units import places_of
from porter.errors import OutputFolderError
from porter.format import safetensors_io
from porter.format.safe_files import create_new, replace_into
from porter.format.safetensors_io import (
    SHARD_METADATA,
    Entry,
    dtype_name,
    header_bytes,
    pwrite_all,
    shard_digest,
    tensor_bytes,
)


class Writeback:
    """One background thread that asks the kernel to start writing ranges to disk, so a worker never waits in
    sync_file_range for a full disk queue. It owns a dup of each shard's descriptor and closes it after the
    shard's last range (FIFO), so a range is never flushed through a reused fd."""

    MAX_FDS = 64  # dups held at once; a shard opened past this (the thread lagging far) writes back inline

    def __init__(self):
        self.queue = queue.SimpleQueue()
        self.fds: set = set()  # dups not closed yet (stop closes what a failed run left)
        self.thread = threading.Thread(target=self._loop, name="porter-writeback", daemon=True)
        self.thread.start()

    def open(self, fd: int) -> Optional[int]:
        """A dup of fd for this thread, or None when MAX_FDS are open (the caller writes back inline)."""
        if len(self.fds) >= self.MAX_FDS:
            return None
        dup = os.dup(fd)
        self.fds.add(dup)
        return dup

    def submit(self, fd: int, offset: int, length: int) -> None:
        self.queue.put((fd, offset, length))

    def close(self, fd: int) -> None:
        self.queue.put((fd, None, None))

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()
        for fd in list(self.fds):
            self._close(fd)

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            fd, offset, length = item
            if offset is None:
                self._close(fd)
                continue
            try:
                start_writeback(fd, offset, length)  # a hint; the final fsync reports write errors
            except Exception:  # noqa: BLE001 — the thread must keep closing the dups it owns
                pass

    def _close(self, fd: int) -> None:
        self.fds.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass


class ShardOut:
    """One output shard: `.partial` written with pwrite, renamed once every tensor's digest and every error
    record is in (`todo` counts those events)."""

    def __init__(
        self, path: Path, entries: list, todo: int, on_closed: Callable, flusher: Optional[Writeback]
    ):
        self.path, self.entries, self.on_closed = path, entries, on_closed
        self.partial = path.with_name(path.name + ".partial")
        header = header_bytes(entries, SHARD_METADATA)
        self.fd = create_new(self.partial, OutputFolderError)  # never through a link planted at that name
        os.ftruncate(self.fd, len(header) + sum(e.nbytes for e in entries))
        self.flusher = flusher
        self.wb_fd = flusher.open(self.fd) if flusher is not None else None  # None: writeback inline
        self.lock = threading.Lock()
        self.todo = todo
        self.header_sha256 = hashlib.sha256(header).hexdigest()
        pwrite_all(self.fd, memoryview(header), 0)

    def write(self, data: memoryview, offset: int) -> None:
        """data at `offset` of the shard; then start its writeback."""
        pwrite_all(self.fd, data, offset)
        if self.wb_fd is not None:
            self.flusher.submit(self.wb_fd, offset, len(data))
        else:
            start_writeback(self.fd, offset, len(data))

    def event(self) -> None:
        with self.lock:
            self.todo -= 1
            last = self.todo == 0
        if last:  # no fsync here: the end syncs every shard before the index is written, and --resume
            os.close(self.fd)  # re-hashes every journaled shard, so a torn one is rewritten
            self.fd = None
            self._close_writeback()
            replace_into(self.partial, self.path, OutputFolderError)
            fault_point("shard-renamed")
            self.on_closed(self)

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._close_writeback()

    def _close_writeback(self) -> None:
        if self.wb_fd is not None:
            self.flusher.close(self.wb_fd)
            self.wb_fd = None


class ShardWriter:
    """Every output shard of a plan, opened on its first write: places bytes, feeds the tensors' digests,
    collects the per-tensor records in `stats` and hands each finished shard's record to on_shard_done."""

    def __init__(self, plan, out: Path, done: dict, stats: dict, on_shard_done: Callable[[str, dict], None]):
        self.out, self.done, self.stats, self.on_shard_done = out, done, stats, on_shard_done
        self.digest = plan.digest
        self.places = places_of(plan.shards)
        self.entries_of = dict(plan.shards)
        self.quantized = {t.name for t in plan.tensors if t.quantize}
        self.lock = threading.RLock()  # re-entered when a zero-byte tensor's hash completes at creation
        self.journal_lock = threading.Lock()  # on_shard_done calls, one at a time (see _closed)
        self.shards: dict = {}
        self.tensor_digest: dict = {}
        self.flusher: Optional[Writeback] = None

    def start(self) -> None:
        self.flusher = Writeback()

    def stop(self, failed: bool) -> None:
        """After the workers: close what a failed run left open, and the writeback thread."""
        if failed:
            for s in self.shards.values():
                s.abort()
        if self.flusher is not None:
            self.flusher.stop()

    def unfinished(self) -> list:
        return [f for f, s in self.shards.items() if s.fd is not None]

    def shard_of(self, name: str) -> str:
        return self.places[name].shard

    def deposit(self, name: str, offset: int, value: torch.Tensor) -> None:
        """Write value's bytes at `offset` within tensor `name` and hash the digest chunks this completes, so
        value can be dropped (or its buffer reused) once this returns."""
        place = self.places[name]
        if place.shard in self.done:
            return
        data = tensor_bytes(value)
        if offset + len(data) > place.nbytes:
            raise RuntimeError(f"{name}: produced bytes beyond its planned {place.nbytes}")
        shard = self._shard(place.shard)
        if not len(data):  # a 0-byte tensor: its digest completed when the shard opened (maybe closing it)
            return
        shard.write(data, place.offset + offset)
        self.tensor_digest[name].add(offset, data)

    def record_error(self, name: str, record: dict) -> None:
        """A quantized tensor's error statistics: one of the events its shard waits for."""
        f = self.places[name].shard
        if f in self.done:
            return
        shard = self._shard(f)
        with self.lock:
            self.stats.setdefault(name, {}).update(record)
        shard.event()

    def _shard(self, f: str) -> ShardOut:
        with self.lock:
            s = self.shards.get(f)
            if s is None:
                s = self.shards[f] = ShardOut(
                    self.out / f, self.entries_of[f], self._todo(f), self._closed, self.flusher
                )
                for e in self.entries_of[f]:
                    p = self.places[e.name]
                    self.tensor_digest[e.name] = TensorDigest(
                        s.fd,
                        s.partial,
                        p.offset,
                        p.nbytes,
                        safetensors_io.DIGEST_CHUNK_BYTES,
                        lambda d, e=e, s=s: self._tensor_hashed(s, e, d),
                        self.digest,
                    )
            return s

    def _todo(self, f: str) -> int:
        """Events a shard waits for: each tensor's digest, each quantized tensor's error record."""
        return sum(1 + (e.name in self.quantized) for e in self.entries_of[f])

    def _tensor_hashed(self, shard: ShardOut, e: Entry, digest: str) -> None:
        with self.lock:
            record = {
                "shard": self.places[e.name].shard,
                "dtype": dtype_name(e.dtype),
                "shape": list(e.shape),
                "digest": digest,
            }
            self.stats.setdefault(e.name, {}).update(record)
        shard.event()

    def _closed(self, shard: ShardOut) -> None:
        """Hands the finished shard's record to on_shard_done (the journal: a file write with fsync) outside
        the lock, so only the workers that finish shards wait for those fsyncs."""
        with self.lock:
            tensors = {e.name: dict(self.stats[e.name]) for e in shard.entries}
            digests = [tensors[e.name]["digest"] for e in shard.entries]
            record = {
                "header_sha256": shard.header_sha256,
                "tensors": tensors,
                "digest": shard_digest(shard.header_sha256, digests),
            }
        with self.journal_lock:
            self.on_shard_done(shard.path.name, record)
