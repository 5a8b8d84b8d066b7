"""Staged weight loading: shards read with large reads by a pool of threads into a few page-locked buffers,
copied from there to the tensors' devices, each tensor's bytes checked against porter.json's digest on the
way (docs/runtime.md, "Loading").

    staging = Staging(spans, digests, progress=bar)   # spans: every tensor to load, with its device
    staging.start()
    w = staging.take("model.layers.0.mlp.gate_proj.weight")   # waits until its bytes are on its device
    staging.finish()                                          # every tensor read and checked, or LoadError

Each thread owns one staging buffer (`buffer_bytes`, page-locked when a destination is a GPU) and takes the
next *item* in turn: a contiguous byte range of one shard, at most one buffer long, cut at digest-chunk
boundaries (porter.format.safetensors_io.digest_rule). It reads the item in READ_BLOCK pieces, hashes each
piece while it is still in the CPU's cache, copies the item's tensor segments to their devices (a CUDA
stream per thread and device) and waits for that copy before it reads the next item into the same buffer.
So host memory stays at threads x buffer_bytes whatever the model's size, file reads of one thread overlap
the copies of the others, and the caller builds the model (the MoE backend's weight preparation) from the
tensors already taken while later ones are read. Items of different devices are interleaved in proportion
to each device's bytes, so every GPU of a device_map receives its weights at once.

A tensor is handed out only when all its bytes are on its device and their digest is porter.json's; the
first failure (a truncated shard, bytes that changed after the conversion) stops every thread and is raised
by `take` and `finish` as a LoadError naming the shard and the tensor, so no model is built from it.
With `checked` (porter verify), each tensor's digest is handed to it instead and the tensor handed out:
verify's integrity names every changed tensor (porter.commands.verify.digests). With `finished` (a load's
record of what it checked, porter.format.checked), `finish` hands it the spans it checked once all matched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm import tqdm

from porter.cores import available_cores
from porter.errors import LoadError, PorterError
from porter.format.digest import CHUNK_HASHES
from porter.format.safetensors_io import ST_DTYPES, parse_header, pread_into, tensor_digest

log = logging.getLogger("porter.runtime")

READ_BLOCK = 4 << 20  # bytes per read call, hashed right after it while still in the CPU's caches
BUFFER_BYTES = 32 << 20  # per thread; two 16 MiB digest chunks
MAX_THREADS = 16  # past this page-cache copies stop scaling on a 16-core host (docs/performance.md)


def default_threads() -> int:
    return max(2, min(MAX_THREADS, available_cores()))


@dataclass(frozen=True)
class Span:
    """One tensor to load: its bytes [offset, offset + nbytes) of `path` go to a new tensor on `device`.
    digest: porter.json's digest of those bytes (None: not checked)."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple
    device: torch.device
    digest: Optional[str] = None


@dataclass(frozen=True)
class DigestRule:
    """porter.json's digest rule: the chunk size and the chunk hash's name (porter.format.digest.CHUNK_HASHES)."""

    chunk_bytes: int
    name: str

    def new_hash(self):
        return CHUNK_HASHES[self.name]()


@dataclass
class _Chunk:
    """One digest chunk of a tensor that spans several items (only when buffer_bytes < chunk_bytes): its
    pieces are hashed in order, by whichever threads read them."""

    hasher: object
    pieces: int
    next_piece: int = 0


@dataclass
class _Piece:
    """The bytes of one digest chunk inside one item: [at, at + length) of the item's buffer."""

    tensor: "_Tensor"
    chunk: int  # index of the digest chunk in its tensor
    at: int
    length: int
    shared: Optional[_Chunk] = None  # set when the chunk continues in another item
    seq: int = 0  # this piece's place among the shared chunk's pieces


@dataclass
class _Segment:
    """Bytes of one tensor inside one item: the buffer's [at, at + length) -> the tensor's [dst, dst + length)."""

    tensor: "_Tensor"
    dst: int
    at: int
    length: int


@dataclass
class _Item:
    path: Path
    offset: int
    length: int
    device: torch.device
    segments: list = field(default_factory=list)
    pieces: list = field(default_factory=list)


@dataclass
class _Tensor:
    span: Span
    chunks: int  # digest chunks (0 when not checked or empty)
    remaining: int  # bytes not yet on the device
    digests: dict = field(default_factory=dict)  # chunk index -> chunk digest (bytes)
    flat: Optional[torch.Tensor] = None  # uint8 [nbytes] on the device, allocated by the first item


class Staging:
    """See the module docstring. progress: show a bar (bytes, GB/s, ETA) on stderr while loading."""

    def __init__(
        self,
        spans: list,
        rule: Optional[DigestRule] = None,
        threads: Optional[int] = None,
        buffer_bytes: int = BUFFER_BYTES,
        progress: bool = False,
        allocate_now: bool = False,
        log_level: int = logging.INFO,
        checked: Optional[Callable[[str, str], None]] = None,
        finished: Optional[Callable[[list], None]] = None,
        hash_on_device: Optional[Callable[[torch.Tensor, int], object]] = None,
    ):
        if buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be positive, not {buffer_bytes}")
        self.rule, self.buffer_bytes, self.show_progress = rule, buffer_bytes, progress
        self.checked = checked  # given: (name, digest) of each tensor read, compared by the caller
        self.finished = finished  # given: the spans whose digests matched, once finish() found them all so
        # given: (tensor's bytes on its device, chunk bytes) -> its chunk digests in flight (ready(), result():
        # runtime/kernels/xxh3.py's PendingDigests), launched by the thread that completes a tensor, instead
        # of hashing each piece on the reading threads
        self.hash_on_device = hash_on_device
        self.allocate_now, self.log_level = allocate_now, log_level
        self.progress = None
        self.threads = threads or default_threads()
        self._tensors = {s.name: _Tensor(s, 0, s.nbytes) for s in spans}
        self._items = _interleave([self._items_of(p) for p in _by_device(spans)])
        self._pin = any(s.device.type == "cuda" for s in spans) and torch.cuda.is_available()
        self._cond = threading.Condition()
        self._next = 0  # the next item a thread takes
        self._ready: dict = {}  # name -> tensor on its device, checked, not yet taken
        self._taken: set = set()
        self._error: Optional[BaseException] = None
        self._stop = False
        self._fds: dict = {}
        self._workers: list = []
        self.total_bytes = sum(s.nbytes for s in spans)
        # seconds: wall from start(); summed over threads in reads, hashing, copies; the caller blocked in take
        self.stats = {"wall": 0.0, "read": 0.0, "hash": 0.0, "copy": 0.0, "waited": 0.0}
        self._t0 = 0.0
        self._allocated: dict = {}  # device -> CUDA event recorded after allocate_now's allocations
        for t in self._tensors.values():
            if t.span.nbytes == 0:
                self._complete(t)

    # -- planning -----------------------------------------------------------------------------------------
    def _items_of(self, spans: list) -> list:
        """Items (file order, one device) covering `spans`: whole digest chunks per item where a chunk fits
        the buffer, a chunk cut into buffer-sized pieces where it does not."""
        items: list = []
        cur: Optional[_Item] = None
        for s in sorted(spans, key=lambda s: (str(s.path), s.offset)):
            t = self._tensors[s.name]
            step = self.rule.chunk_bytes if self.rule and s.digest is not None else max(s.nbytes, 1)
            t.chunks = -(-s.nbytes // step) if self.rule and s.digest is not None else 0
            for k, begin in enumerate(range(0, s.nbytes, step)):
                n = min(step, s.nbytes - begin)
                whole = n <= self.buffer_bytes
                parts = [(begin, n)] if whole else _cuts(begin, n, self.buffer_bytes)
                hashed_here = t.chunks and self.hash_on_device is None  # on the reading threads
                shared = None if whole or not hashed_here else _Chunk(self.rule.new_hash(), len(parts))
                for seq, (b, m) in enumerate(parts):
                    if (
                        cur is None
                        or cur.path != s.path
                        or cur.offset + cur.length != s.offset + b
                        or cur.length + m > self.buffer_bytes
                    ):
                        cur = _Item(s.path, s.offset + b, 0, s.device)
                        items.append(cur)
                    if cur.segments and cur.segments[-1].tensor is t:
                        cur.segments[-1].length += m
                    else:
                        cur.segments.append(_Segment(t, b, cur.length, m))
                    if hashed_here:
                        cur.pieces.append(_Piece(t, k, cur.length, m, shared, seq))
                    cur.length += m
        return items

    # -- running ------------------------------------------------------------------------------------------
    def start(self) -> "Staging":
        """Start the threads. allocate_now: every tensor's device memory is taken here, on the calling
        thread, and the copies wait only for work queued on its stream before this point; otherwise each
        tensor's memory is taken by the thread that first copies into it (the whole model is then not
        resident before the build has prepared its first layers) and the copy waits for everything queued
        on that device's default stream by then."""
        self._t0 = time.perf_counter()
        if self.allocate_now:
            for t in self._tensors.values():
                dev = t.span.device
                if t.flat is None and t.remaining:
                    with torch.inference_mode(False):  # called inside a forward: the threads write into it
                        t.flat = torch.empty(t.span.nbytes, dtype=torch.uint8, device=dev)
                if dev.type == "cuda" and dev not in self._allocated:
                    self._allocated[dev] = None
            for dev in self._allocated:
                self._allocated[dev] = torch.cuda.Event()
                self._allocated[dev].record(torch.cuda.current_stream(dev))
        self.progress = tqdm(
            total=self.total_bytes, unit="B", unit_scale=True, desc="load", disable=not self.show_progress
        )
        for i in range(min(self.threads, len(self._items))):
            w = threading.Thread(target=self._work, name=f"porter-load-{i}", daemon=True)
            w.start()
            self._workers.append(w)
        return self

    def take(self, name: str) -> torch.Tensor:
        """The tensor `name` on its device, its bytes checked (waits for them). Each name is taken once."""
        if name not in self._tensors or name in self._taken:
            raise KeyError(f"{name!r} is not staged (or was taken)")
        with self._cond:
            t = time.perf_counter()
            while name not in self._ready and self._error is None and not self._stop:
                self._cond.wait()
            self.stats["waited"] += time.perf_counter() - t
            self._raise()
            if name not in self._ready:
                raise LoadError(f"{self._tensors[name].span.path}: loading stopped before {name!r} was read")
            self._taken.add(name)
            return self._ready.pop(name)

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` on its device (waits for it), kept for further get()s until close()."""
        if name not in self._tensors:
            raise KeyError(f"{name!r} is not staged")
        with self._cond:
            while name not in self._ready and self._error is None and not self._stop:
                self._cond.wait()
            self._raise()
            if name not in self._ready:
                raise LoadError(f"{self._tensors[name].span.path}: reading stopped before {name!r} was read")
            return self._ready[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tensors and name not in self._taken

    def finish(self) -> None:
        """Wait until every tensor is read and checked; raise the first failure."""
        with self._cond:
            t = time.perf_counter()
            while (
                self._error is None
                and not self._stop
                and len(self._ready) + len(self._taken) < len(self._tensors)
            ):
                self._cond.wait()
            self.stats["waited"] += time.perf_counter() - t
            done = len(self._ready) + len(self._taken) == len(self._tensors)
        self.close()
        self._raise()
        if not done:
            raise LoadError(
                f"loading {self.total_bytes / 1e9:.2f} GB was stopped before every tensor was read"
            )
        if self.finished is not None and self.rule is not None and self.checked is None:
            self.finished([t.span for t in self._tensors.values() if t.span.digest is not None])
        st = self.stats
        st["wall"] = time.perf_counter() - self._t0
        log.log(
            self.log_level,
            "staged %.2f GB in %.2f s (%.1f GB/s) on %d thread(s) x %d MiB buffers: thread time in reads "
            "%.2f s, digests %.2f s, copies %.2f s; the model build waited %.2f s for bytes",
            self.total_bytes / 1e9,
            st["wall"],
            self.total_bytes / 1e9 / max(st["wall"], 1e-9),
            self.threads,
            self.buffer_bytes >> 20,
            st["read"],
            st["hash"],
            st["copy"],
            st["waited"],
        )

    def close(self) -> None:
        """Stop the threads (each finishes the item in hand), close the shards, drop tensors not taken."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for w in self._workers:
            w.join()
        self._workers.clear()
        if self.progress is not None:
            self.progress.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._ready.clear()
        for t in self._tensors.values():
            t.flat = None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = e
            self._stop = True
            self._cond.notify_all()

    def _work(self) -> None:
        buf, streams, clock = None, {}, {"read": 0.0, "hash": 0.0, "copy": 0.0}
        hashing: list = []  # (tensor, its digests in flight on its device), oldest first
        try:
            while True:
                with self._cond:
                    if self._stop or self._next == len(self._items):
                        break
                    item = self._items[self._next]
                    self._next += 1
                if buf is None:
                    buf = self._new_buffer()
                self._stage(item, buf, streams, clock, hashing)
                self._settle(hashing, clock, wait=False)
            self._settle(hashing, clock, wait=True)
        except _Stopped:
            return
        except PorterError as e:
            self._fail(LoadError(str(e)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, raised there
            self._fail(e)
        finally:
            with self._cond:
                for k, v in clock.items():
                    self.stats[k] += v

    def _new_buffer(self) -> torch.Tensor:
        """This thread's staging buffer, page-locked when a destination is a GPU (asynchronous copies)."""
        return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self._pin)

    def _stage(self, item: _Item, buf: torch.Tensor, streams: dict, clock: dict, hashing: list) -> None:
        fd = self._fd(item.path)
        data = memoryview(buf.numpy())
        hashers = [None if p.shared else self.rule.new_hash() for p in item.pieces]
        if hasattr(os, "posix_fadvise"):  # a cold file: the whole item in flight at once
            os.posix_fadvise(fd, item.offset, item.length, os.POSIX_FADV_WILLNEED)
        p, t = 0, time.perf_counter()
        for at in range(0, item.length, READ_BLOCK):
            end = min(at + READ_BLOCK, item.length)
            pread_into(fd, data[at:end], item.offset + at, item.path)
            t1 = time.perf_counter()
            clock["read"] += t1 - t
            while p < len(item.pieces) and item.pieces[p].at < end:  # hash what this block completed
                piece = item.pieces[p]
                if hashers[p] is not None:
                    lo, hi = max(piece.at, at), min(piece.at + piece.length, end)
                    hashers[p].update(data[lo:hi])
                if piece.at + piece.length > end:
                    break
                p += 1
            t = time.perf_counter()
            clock["hash"] += t - t1
        digests = [
            self._hash_shared(pc, data) if h is None else h.digest() for pc, h in zip(item.pieces, hashers)
        ]
        t = time.perf_counter()
        self._copy(item, buf, streams)
        clock["copy"] += time.perf_counter() - t
        on_device = []  # tensors this item completed whose digests are computed on their device
        with self._cond:
            for piece, d in zip(item.pieces, digests):
                if d is not None:
                    piece.tensor.digests[piece.chunk] = d
            for seg in item.segments:
                seg.tensor.remaining -= seg.length
                if seg.tensor.remaining == 0:
                    if seg.tensor.chunks and self.hash_on_device is not None:
                        on_device.append(seg.tensor)
                    else:
                        self._complete(seg.tensor)
        for tensor in on_device:  # launched on this thread's stream; completed by _settle
            began = time.perf_counter()
            stream = streams.get(tensor.span.device)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                hashing.append((tensor, self.hash_on_device(tensor.flat, self.rule.chunk_bytes)))
            clock["hash"] += time.perf_counter() - began
        if self.progress is not None:
            self.progress.update(item.length)

    def _settle(self, hashing: list, clock: dict, wait: bool) -> None:
        """Hand out the tensors whose digests, computed on their device, are in (wait: all of them). The
        digests were launched after every copy into the tensor had finished (the threads wait for their
        copies before counting them), so the reading thread goes on while its device hashes."""
        while hashing and (wait or hashing[0][1].ready()):
            t, pending = hashing.pop(0)
            began = time.perf_counter()
            digests = pending.result()
            clock["hash"] += time.perf_counter() - began
            with self._cond:
                t.digests = dict(enumerate(digests))
                self._complete(t)

    def _hash_shared(self, piece: _Piece, data: memoryview) -> Optional[bytes]:
        """Feed a piece of a chunk that spans items to the chunk's hasher in order; the chunk's digest once
        its last piece is in, else None. Pieces are taken in order, so the one waited for is in hand."""
        c = piece.shared
        with self._cond:
            while c.next_piece != piece.seq and not self._stop:
                self._cond.wait()
            if self._stop:
                raise _Stopped()
        c.hasher.update(data[piece.at : piece.at + piece.length])
        with self._cond:
            c.next_piece += 1
            last = c.next_piece == c.pieces  # no thread touches the hasher after its last piece
            self._cond.notify_all()
        return c.hasher.digest() if last else None

    def _copy(self, item: _Item, buf: torch.Tensor, streams: dict) -> None:
        """The item's segments into their tensors (allocated here on first use); returns when the copy is
        done, so the buffer can take the next item."""
        dev = item.device
        fresh = False
        with self._cond:
            for seg in item.segments:
                if seg.tensor.flat is None:
                    seg.tensor.flat = torch.empty(seg.tensor.span.nbytes, dtype=torch.uint8, device=dev)
                    fresh = True
        if dev.type != "cuda":
            for seg in item.segments:
                seg.tensor.flat[seg.dst : seg.dst + seg.length].copy_(buf[seg.at : seg.at + seg.length])
            return
        stream = streams.get(dev)
        if stream is None:
            stream = streams[dev] = torch.cuda.Stream(device=dev)
        if dev in self._allocated:  # memory freed before start() may still be read by kernels queued then
            stream.wait_event(self._allocated[dev])
        elif fresh:  # memory the caller's stream freed a moment ago may still be read by its queued kernels
            stream.wait_stream(torch.cuda.default_stream(dev))
        with torch.cuda.stream(stream):
            for seg in item.segments:
                seg.tensor.flat[seg.dst : seg.dst + seg.length].copy_(
                    buf[seg.at : seg.at + seg.length], non_blocking=True
                )
        stream.synchronize()

    def _complete(self, t: _Tensor) -> None:
        """All of t's bytes are on its device: check the digest, hand it out (caller holds the lock, or
        construction)."""
        s = t.span
        if self.rule and s.digest is not None:
            got = tensor_digest([t.digests[k] for k in range(t.chunks)])  # sha256(b"") for an empty one
            if self.checked is not None:  # verify names every changed tensor (integrity), a load the first
                self.checked(s.name, got)
            elif got != s.digest and t.chunks:
                raise LoadError(
                    f"{s.path}: tensor {s.name!r} differs from porter.json's digest (the shard changed "
                    "after the conversion); reconvert or restore it"
                )
            elif got != s.digest:
                raise LoadError(
                    f"{s.path}: tensor {s.name!r} is empty but porter.json's digest is not; reconvert"
                )
        flat = t.flat if t.flat is not None else torch.empty(0, dtype=torch.uint8, device=s.device)
        self._ready[s.name] = flat.view(s.dtype).view(s.shape)
        t.flat = None
        self._cond.notify_all()

    def _fd(self, path: Path) -> int:
        with self._cond:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd


def file_spans(files: dict, device: torch.device) -> list:
    """Spans of tensors in safetensors files: {tensor name: file} -> each onto `device` (each file's header
    parsed once; no digest)."""
    headers, out = {}, []
    for name, f in files.items():
        if f not in headers:
            headers[f] = parse_header(f)
        start, header = headers[f]
        info = header[name]
        begin, end = info["data_offsets"]
        out.append(
            Span(
                name,
                Path(f),
                start + begin,
                end - begin,
                ST_DTYPES[info["dtype"]],
                tuple(info["shape"]),
                device,
            )
        )
    return out


class _Stopped(Exception):
    """A thread gave up waiting because another one failed (the first failure is the one raised)."""


def _cuts(begin: int, n: int, size: int) -> list:
    return [(b, min(size, begin + n - b)) for b in range(begin, begin + n, size)]


def _by_device(spans: list) -> list:
    out: dict = {}
    for s in spans:
        out.setdefault(s.device, []).append(s)
    return list(out.values())


def _interleave(per_device: list) -> list:
    """One order of all items: each device's in its own order, the devices advancing together (by the
    fraction of their bytes already scheduled), so a device_map's GPUs are fed at once."""
    keyed = []
    for items in per_device:
        total, done = sum(i.length for i in items) or 1, 0
        for i in items:
            keyed.append((done / total, len(keyed), i))
            done += i.length
    return [i for _, _, i in sorted(keyed, key=lambda k: (k[0], k[1]))]
