"""Integrity's data check on the exact pass's reads (porter/commands/verify/digests.py): the digests it
gathers from reads in any order and of any cut (expert slices, chunks spanning experts, staged reads) are
the shards' own; what was not read is hashed at the end; a changed byte is named in integrity's words and
verify stops before the numerics, a changed header before exact bytes; verify reads the artifact once."""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from verify_tamper import flip_byte

import porter
from porter.commands.verify import digests as digests_mod
from porter.commands.verify import verify
from porter.commands.verify.digests import TensorDigests
from porter.commands.verify.mapping import ArtifactReader
from porter.format.safetensors_io import file_digests, parse_header

CPU = torch.device("cpu")
CHUNK = 4096  # small: most chunks of a stacked tensor span two experts
W13 = "model.layers.2.block_sparse_moe.experts.w13_weight"

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("digests") / "art"
    porter.convert(tiny_vendor, out, progress=False, max_shard_size="300KB")  # several shards
    return out


def _man(art: Path) -> dict:
    return json.loads((art / "porter.json").read_text())


def _shard_digests(art: Path, chunk: int) -> dict:
    with ThreadPoolExecutor(2) as pool:
        return {
            n: d
            for f in sorted(art.glob("*.safetensors"))
            for n, d in file_digests(f, pool, chunk, "xxh3-128").tensors.items()
        }


@pytest.mark.parametrize("chunk", [CHUNK, None])  # 4 KiB, or porter.json's 16 MiB: one chunk of E pieces
def test_reads_in_any_order_and_cut_give_the_shards_digests(artifact, chunk):
    """Every tensor read expert by expert (stacked) or whole, in a shuffled order on 3 threads: each digest
    complete from the reads alone, equal to the file's; with porter.json's rule nothing is left to hash
    and nothing differs."""
    man = _man(artifact)
    chunk = chunk or man["digest"]["chunk_bytes"]
    d = TensorDigests(artifact, man, chunk, "xxh3-128")
    reader = ArtifactReader(artifact, man, digests=d)
    reads = [(n, e) for n in reader.tensors for e in (range(reader.experts(n) or 0) or [None])]
    stacked = [n for n in reader.tensors if reader.experts(n)]
    assert stacked and any(reader.nbytes(n) // reader.experts(n) % CHUNK for n in stacked)  # chunks span
    random.Random(0).shuffle(reads)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda r: reader._read(*r), reads))
    assert d.got == _shard_digests(artifact, chunk) and not d._pieces and not d._chunks
    if chunk == man["digest"]["chunk_bytes"]:
        rest = []
        real = d._hash_rest
        d._hash_rest = lambda path, start, header, pool: (
            rest.extend(set(header) - set(d.got)) or real(path, start, header, pool)
        )
        assert d.finish() == [] and rest == []


def test_what_was_not_read_is_hashed_at_the_end_and_named(artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    flip_byte(art, W13, index=5000)
    man = _man(art)
    d = TensorDigests(art, man, *(man["digest"]["chunk_bytes"], "xxh3-128"))
    ArtifactReader(art, man, digests=d)._read("model.embed_tokens.weight")  # one tensor read, the rest not
    (f,) = d.finish()
    assert f.check == "integrity" and f.tensor == W13 and f.shard == man["tensors"][W13]["shard"]
    assert f.message == (
        f"tensor {W13} in shard {f.shard}: digest differs from porter.json (the data changed after conversion)"
    )
    assert set(d.got) == set(man["tensors"])


def test_staged_reads_hand_their_digests_over(artifact, tmp_path):
    """The staged reader (a GPU's read-ahead; here onto the CPU) hashes as it reads and hands out even a
    changed tensor: the digests decide, in finish."""
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    flip_byte(art, W13, index=10)
    man = _man(art)
    d = TensorDigests(art, man, man["digest"]["chunk_bytes"], "xxh3-128")
    reader = ArtifactReader(art, man, digests=d)
    staging = reader.stage([W13, "model.norm.weight"], CPU)
    q, s = reader.get(W13, 1)
    assert q.shape == tuple(man["tensors"][W13]["shape"][1:]) and s is not None
    staging.finish()
    assert {W13, W13 + "_scale", "model.norm.weight"} <= set(d.got)
    # what a layer-streamed pass asks after comparing a layer: only tensors read whole so far are judged
    assert d.changed([W13, "model.norm.weight"]) == [W13] and d.changed(["model.norm.weight"]) == []
    assert d.changed(["model.embed_tokens.weight"]) == []  # not read yet: finish() hashes and judges it
    assert [f.tensor for f in d.finish()] == [W13]


def _count_reads(monkeypatch) -> dict:
    """Bytes verify reads from the artifact's shards through the exact pass and through hashing (the
    mapped reads of ArtifactReader, the chunk reads of digests and of integrity)."""
    seen = {"exact": 0, "hashed": 0}
    real_read, real_chunk = ArtifactReader._read, digests_mod.read_chunk_digest

    def read(self, name, e=None):
        t = real_read(self, name, e)
        seen["exact"] += t.nbytes
        return t

    def chunk(fd, offset, length, path, h):
        seen["hashed"] += length
        return real_chunk(fd, offset, length, path, h)

    monkeypatch.setattr(ArtifactReader, "_read", read)
    monkeypatch.setattr(digests_mod, "read_chunk_digest", chunk)
    monkeypatch.setattr("porter.commands.verify.integrity.file_digests", None)  # never hashed up front
    return seen


def test_verify_reads_the_artifact_once_in_integrity_and_exact(artifact, monkeypatch):
    """Counted up to the numerics (whose loads are the runtime's): every tensor byte once, by exact bytes."""
    seen, reached = _count_reads(monkeypatch), []

    def numerics(rep, *a, **k):
        reached.append(rep)
        raise StopIteration

    monkeypatch.setattr("porter.commands.verify._numerics", numerics)
    with pytest.raises(StopIteration):
        verify(artifact, max_new_tokens=0)
    (rep,) = reached
    assert rep.integrity.passed and rep.exact.passed
    spans = [i["data_offsets"] for f in artifact.glob("*.safetensors") for i in parse_header(f)[1].values()]
    assert seen == {"exact": sum(e - b for b, e in spans), "hashed": 0}


@pytest.mark.parametrize("pass_", ["resident", "streamed", "streamed, staged"])
def test_changed_byte_fails_integrity_after_exact_and_stops(artifact, tmp_path, monkeypatch, pass_):
    """The outcome users saw when integrity hashed first: integrity fails naming the tensor, exact bytes'
    results (which differ there too) are not shown, the numerics are not reported. Layer-streamed, exact
    bytes runs inside the pass and stops it at the changed tensor's layer, before the converted model is
    built from it (its loader would refuse the tensor with a load error)."""
    from porter.commands.verify import exact

    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    flip_byte(art, W13, index=70 * 256 + 3)
    from runtime.staging import Staging

    started, real_start = [], Staging.start
    monkeypatch.setattr(Staging, "start", lambda self: started.append(self) or real_start(self))
    if pass_ == "streamed, staged":  # what a GPU does: each layer staged, hashed as it is read
        monkeypatch.setattr(exact, "reads_ahead", lambda device: True)
    compared = []
    real = exact.ExactBytes.run_layer
    monkeypatch.setattr(exact.ExactBytes, "run_layer", lambda self, i: compared.append(i) or real(self, i))
    res = verify(art, streaming=pass_ != "resident")
    (f,) = res.failures
    assert not res.passed and f.check == "integrity" and f.tensor == W13
    assert res.report.exact is None and res.report.layers == [] and not res.report.integrity.passed
    assert res.report.generation == [] and res.report.logits is None
    if pass_ == "resident":
        assert "exact" in res.report.phases and "generation" not in res.report.phases and compared == []
    else:  # stopped at layer 2 (layer 0 is dense: its tensors outside the experts compared in the pass too)
        assert compared == [0, 1, 2] and "numerics.pass" in res.report.phases
    assert (len(started) > 4) == (pass_ == "streamed, staged")
    assert all(s._stop for s in started)  # nothing left read ahead: the layer after the stop was dropped


def test_changed_header_fails_before_exact(artifact, tmp_path, monkeypatch):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    shard = art / _man(art)["tensors"][W13]["shard"]
    raw = bytearray(shard.read_bytes())
    at = raw.index(b'"format":"pt"')
    raw[at + 10 : at + 12] = b"PT"
    shard.write_bytes(bytes(raw))
    monkeypatch.setattr("porter.commands.verify.ExactBytes", None)  # never reached
    res = verify(art)
    (f,) = res.failures
    assert f.check == "integrity" and "(the header changed)" in f.message and res.report.exact is None
    assert set(res.report.phases) == {"integrity"}
