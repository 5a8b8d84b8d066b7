"""porter.engine.digests.TensorDigest: the chunked digest of a tensor written out of order, by many threads, equals
the digest of its bytes (docs/artifact-format.md, "Digests"), and bytes that arrive in order are hashed as
they come, not read back."""

from __future__ import annotations

import os
import random
import threading

import pytest
from tensor_checks import chunk_hash

from porter.engine import digests
from porter.format.digest import CHUNK_HASHES
from porter.format.safetensors_io import chunk_spans, tensor_digest

CHUNK = 1 << 12  # 4 KiB chunks: many chunks, pieces of every alignment


@pytest.fixture(params=list(CHUNK_HASHES))
def hash_name(request):
    return request.param


def expected(data: bytes, hash_name: str) -> str:
    h = chunk_hash(hash_name)
    return tensor_digest([h(data[b : b + n]).digest() for b, n in chunk_spans(len(data), CHUNK)])


def pieces(length: int, rng: random.Random, max_piece: int) -> list:
    out, at = [], 0
    while at < length:
        n = min(length - at, rng.randint(1, max_piece))
        out.append((at, n))
        at += n
    return out


def run_digest(tmp_path, data: bytes, parts: list, threads: int, monkeypatch, hash_name) -> tuple[str, int]:
    """Write `parts` of data (offset, length) at start 100 of a file, reporting each to a TensorDigest;
    threads > 1 share the parts round-robin and run at once. Returns (digest, bytes read back)."""
    path = tmp_path / "shard.partial"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, 100 + len(data))
    read_back = [0]
    real = digests.read_chunk_digest

    def counting(fd_, offset, length, path_, h):
        read_back[0] += length
        return real(fd_, offset, length, path_, h)

    monkeypatch.setattr(digests, "read_chunk_digest", counting)
    done = []
    digest = digests.TensorDigest(fd, path, 100, len(data), CHUNK, done.append, hash_name)
    view = memoryview(data)

    def worker(mine):
        for off, n in mine:
            os.pwrite(fd, view[off : off + n], 100 + off)
            digest.add(off, view[off : off + n])

    if threads == 1:
        worker(parts)
    else:
        ts = [threading.Thread(target=worker, args=(parts[k::threads],)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    os.close(fd)
    assert len(done) == 1, "the digest must complete exactly once"
    return done[0], read_back[0]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("order", ["in order", "shuffled", "reversed"])
def test_digest_of_pieces_in_any_order(tmp_path, monkeypatch, seed, order, hash_name):
    rng = random.Random(seed)
    data = rng.randbytes(rng.randint(1, 9 * CHUNK + 17))
    parts = pieces(len(data), rng, max_piece=rng.choice([100, CHUNK // 3, CHUNK, 3 * CHUNK]))
    if order == "shuffled":
        rng.shuffle(parts)
    elif order == "reversed":
        parts.reverse()
    got, read_back = run_digest(tmp_path, data, parts, 1, monkeypatch, hash_name)
    assert got == expected(data, hash_name)
    if order == "in order":
        assert read_back == 0  # every chunk was hashed from the bytes as they were written
    assert read_back <= len(data)


@pytest.mark.parametrize("seed", range(4))
def test_digest_with_concurrent_writers(tmp_path, monkeypatch, seed, hash_name):
    """4 threads, interleaved pieces of one tensor (as workers writing neighbouring experts): each chunk's
    digest is exact whatever the interleaving (running hash, concurrent feeds refused, read-back of the
    rest), and only the bytes that came out of order are read back."""
    rng = random.Random(100 + seed)
    data = rng.randbytes(64 * CHUNK + 5)
    parts = pieces(len(data), rng, max_piece=CHUNK // 2)
    got, read_back = run_digest(tmp_path, data, parts, 4, monkeypatch, hash_name)
    assert got == expected(data, hash_name)
    assert read_back < len(data)


def test_one_worker_writing_an_expert_in_pieces_reads_nothing_back(tmp_path, monkeypatch, hash_name):
    """The CPU path's shape at 2 workers: an expert's rows in equal pieces smaller than a chunk, in order,
    chunk boundaries not aligned with the expert. Before streaming every chunk was read back."""
    data = random.Random(7).randbytes(37 * CHUNK // 2 + 300)  # 18.5 chunks and a bit
    parts = [(b, min(CHUNK // 16, len(data) - b)) for b in range(0, len(data), CHUNK // 16)]
    got, read_back = run_digest(tmp_path, data, parts, 1, monkeypatch, hash_name)
    assert (got, read_back) == (expected(data, hash_name), 0)


def test_whole_chunk_write_and_empty_tensor(tmp_path, monkeypatch, hash_name):
    data = random.Random(3).randbytes(3 * CHUNK)
    got, read_back = run_digest(tmp_path, data, [(CHUNK, 2 * CHUNK), (0, CHUNK)], 1, monkeypatch, hash_name)
    assert (got, read_back) == (expected(data, hash_name), 0)
    done = []
    digests.TensorDigest(-1, tmp_path / "x", 0, 0, CHUNK, done.append)
    assert done == [tensor_digest([])]
