"""The chunked digest of one tensor whose bytes are written out of order by many threads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from porter.format.digest import CHUNK_HASHES, DEFAULT_DIGEST
from porter.format.safetensors_io import chunk_spans, read_chunk_digest, tensor_digest


class TensorDigest:
    """The digest of bytes [start, start + length) of a shard file written out of order. Writers report each
    range they wrote. A chunk is hashed as its bytes arrive while they arrive in order (one writer at a time
    feeds its running hash); the writer that completes a chunk finishes it, reading back from the page cache
    the bytes that came out of order. This spares the read-back of chunks one worker writes in order."""

    def __init__(
        self,
        fd: int,
        path: Path,
        start: int,
        length: int,
        chunk_bytes: int,
        on_done: Callable[[str], None],
        chunk_hash: str = DEFAULT_DIGEST,
    ):
        self.fd, self.path, self.start, self.chunk, self.on_done = fd, path, start, chunk_bytes, on_done
        self.new_hash = CHUNK_HASHES[chunk_hash]
        self.spans = chunk_spans(length, chunk_bytes)
        self.left = [n for _, n in self.spans]  # bytes of each chunk not written yet
        self.fed = [0] * len(self.spans)  # bytes from each chunk's start in its running hash
        self.hashers: list = [None] * len(self.spans)  # running hash per chunk (None: nothing fed yet)
        self.busy = [False] * len(self.spans)  # a writer is feeding the chunk's hash right now
        self.claimed = [False] * len(self.spans)  # a writer is finishing (or has finished) the chunk
        self.digests: list = [None] * len(self.spans)
        self.todo = len(self.spans)
        self.lock = threading.Lock()
        if not self.spans:
            on_done(tensor_digest([]))

    def add(self, offset: int, data: memoryview) -> None:
        """`data` was written at `offset` (relative to the tensor's start)."""
        if not len(data):  # nothing written; a 0-byte range completes nothing
            return
        feeds, finish = self._claim(offset, offset + len(data))
        for i, lo, hi in feeds:
            if self.hashers[i] is None:
                self.hashers[i] = self.new_hash()
            self.hashers[i].update(data[lo - offset : hi - offset])  # releases the GIL
            with self.lock:
                self.busy[i] = False
                self.fed[i] += hi - lo
                if self.left[i] == 0 and not self.claimed[i]:
                    self.claimed[i] = True
                    finish.append(i)
        for i in finish:
            self._finish(i)

    def _claim(self, offset: int, end: int) -> tuple[list, list]:
        """Counts [offset, end) as written: (chunk parts this writer feeds in order, chunks it finishes)."""
        feeds, finish = [], []
        with self.lock:
            for i in range(offset // self.chunk, (end - 1) // self.chunk + 1):
                b, n = self.spans[i]
                lo, hi = max(b, offset), min(b + n, end)  # this write's part of chunk i
                self.left[i] -= hi - lo
                if not self.busy[i] and lo - b == self.fed[i]:  # continues the bytes hashed so far
                    self.busy[i] = True
                    feeds.append((i, lo, hi))
                elif self.left[i] == 0 and not self.busy[i] and not self.claimed[i]:
                    self.claimed[i] = True
                    finish.append(i)
        return feeds, finish

    def _finish(self, i: int) -> None:
        b, n = self.spans[i]
        fed, h = self.fed[i], self.hashers[i]
        h = self.new_hash() if h is None else h
        if fed == n:
            digest = h.digest()
        else:  # the bytes after the in-order prefix arrived out of order: read them back
            digest = read_chunk_digest(self.fd, self.start + b + fed, n - fed, self.path, h)
        self.hashers[i] = None
        with self.lock:
            self.digests[i] = digest
            self.todo -= 1
            last = self.todo == 0
        if last:
            self.on_done(tensor_digest(self.digests))
