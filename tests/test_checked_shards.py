"""This machine's record of checked shards (porter/format/checked.py) through the staged loader on the CPU
(ArtifactStore.stage, as runtime.load stages onto GPUs): a second load of unchanged shards hashes nothing and
hands out the same bytes; a shard changed through the file system since (a byte, a touch, a rewrite of
porter.json) is hashed again and a changed tensor still fails the load, named; a file changed in the last
RACY_NS is not recorded; rehash, verify's own stores and an unwritable cache hash every byte."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import xxhash

import porter
import runtime
from porter import cache
from porter.errors import LoadError
from porter.format import checked
from porter.format.digest import CHUNK_HASHES
from porter.format.safetensors_io import parse_header
from runtime.loader import open_store

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("checked") / "art"
    porter.convert(tiny_vendor, out, progress=False, max_shard_size="300KB")  # several shards
    return out


@pytest.fixture
def art(artifact, tmp_path, monkeypatch):
    """A fresh copy (its own record), recorded at once: RACY_NS 0 (its files were written a moment ago)."""
    monkeypatch.setattr(checked, "RACY_NS", 0)
    d = tmp_path / "art"
    shutil.copytree(artifact, d)
    return d


@pytest.fixture
def hashed(monkeypatch) -> list:
    """Bytes fed to the digest's chunk hash, as each staging goes (runtime.loader reads CHUNK_HASHES)."""
    fed = []

    class Counting:
        def __init__(self):
            self.h = xxhash.xxh3_128()

        def update(self, b):
            fed.append(len(b))
            self.h.update(b)

        def digest(self):
            return self.h.digest()

    monkeypatch.setitem(CHUNK_HASHES, "xxh3-128", Counting)
    return fed


def _tensors(store) -> set:
    return store.names() - store.carried_names()


def _staged(store) -> dict:
    s = store.stage(lambda n: CPU, buffer_bytes=8192, threads=2)
    try:
        out = {n: store.get(n).clone() for n in _tensors(store)}
        s.finish()
    finally:
        store.unstage()
    return out


def _mapped(store) -> dict:
    return {n: store.get(n).clone() for n in _tensors(store)}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].shape == b[n].shape and torch.equal(
            a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8)
        ), n


def _data_bytes(store) -> int:
    return sum(store.nbytes(n) for n in _tensors(store))


def _flip(store, name: str) -> Path:
    shard = store.files[name]
    start, header = parse_header(shard)
    at = start + header[name]["data_offsets"][0]
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    return shard


def test_second_load_hashes_nothing_and_hands_out_the_same_bytes(art, hashed):
    store = open_store(art, record_checks=True)
    total = _data_bytes(store)
    _same(_staged(store), _mapped(store))
    assert sum(hashed) == total  # the first load hashes every byte
    rec = json.loads(store.checked.file.read_text())
    assert rec["artifact"] == str(art.resolve())
    assert {n for r in rec["shards"].values() for n in r["tensors"]} == _tensors(store)
    hashed.clear()
    again = open_store(art, record_checks=True)
    _same(_staged(again), _mapped(again))
    assert sum(hashed) == 0


def test_a_changed_shard_is_hashed_again_and_a_changed_tensor_named(art, hashed):
    store = open_store(art, record_checks=True)
    _staged(store)
    name = max(sorted(_tensors(store)), key=store.nbytes)
    shard = store.files[name]
    in_shard = sum(store.nbytes(n) for n in _tensors(store) if store.files[n] == shard)
    os.utime(shard)  # the same bytes, a new status-change time: only this shard is hashed again
    hashed.clear()
    _staged(open_store(art, record_checks=True))
    assert sum(hashed) == in_shard and 0 < in_shard < _data_bytes(store)
    _flip(store, name)
    with pytest.raises(LoadError, match=f"{shard}: tensor {name!r} differs from porter.json's digest"):
        _staged(open_store(art, record_checks=True))


def test_a_shard_changed_while_read_without_hashing_fails(art):
    store = open_store(art, record_checks=True)
    _staged(store)
    again = open_store(art, record_checks=True)
    shard = sorted({again.files[n] for n in _tensors(again)})[0]
    s = again.stage(lambda n: CPU, buffer_bytes=8192, threads=2)
    os.utime(shard)
    with pytest.raises(LoadError, match=f"{shard}: changed while it was being loaded"):
        s.finish()
    again.unstage()


def test_another_manifest_trusts_nothing(art, hashed):
    _staged(open_store(art, record_checks=True))
    man = art / "porter.json"
    man.write_text(man.read_text() + "\n")  # the same content, other bytes: the record is not for it
    hashed.clear()
    store = open_store(art, record_checks=True)
    _staged(store)
    assert sum(hashed) == _data_bytes(store)


def test_files_changed_just_before_are_not_recorded(art, hashed, monkeypatch):
    monkeypatch.setattr(checked, "RACY_NS", 3600 * 10**9)  # as if the copy were made within the last hour
    store = open_store(art, record_checks=True)
    _staged(store)
    assert not store.checked.file.exists()
    hashed.clear()
    _staged(open_store(art, record_checks=True))
    assert sum(hashed) == _data_bytes(store)


def test_rehash_and_stores_of_verify_hash_every_byte(art, hashed, monkeypatch):
    _staged(open_store(art, record_checks=True))
    hashed.clear()
    store = open_store(art)  # verify's stores and a caller's own: no record used
    _staged(store)
    assert store.checked is None and sum(hashed) == _data_bytes(store)
    asked = []
    real = runtime.open_store
    monkeypatch.setattr(runtime, "open_store", lambda p, **kw: asked.append(kw) or real(p, **kw))
    runtime.load(art)
    runtime.load(art, rehash=True)
    assert asked == [{"record_checks": True, "rehash": False}, {"record_checks": True, "rehash": True}]
    hashed.clear()
    record = open_store(art, record_checks=True).checked.file
    record.unlink()
    store = open_store(art, record_checks=True, rehash=True)
    _staged(store)
    assert sum(hashed) == _data_bytes(store) and record.exists()  # every byte hashed, and recorded


def test_an_unwritable_cache_is_ignored(art, hashed, monkeypatch, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("PORTER_CACHE_DIR", str(blocked))
    store = open_store(art, record_checks=True)
    _same(_staged(store), _mapped(store))
    hashed.clear()
    _staged(open_store(art, record_checks=True))
    assert sum(hashed) == _data_bytes(store)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PORTER_CACHE_DIR", str(tmp_path / "a"))
    assert cache.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("PORTER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x" / "porter"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_dir() == Path.home() / ".cache" / "porter"


def test_layer_streaming_records_each_layer_as_it_is_checked(art, hashed):
    """A layer-streaming model stages one layer at a time: each staging adds its layer's tensors to the
    record, so the second pass over the layers hashes nothing and computes the same logits."""
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    want = runtime.load(art)(ids)
    store = open_store(art, record_checks=True)
    model = runtime.load(store, lazy=True)
    model.layers.stream_from(store, CPU)
    layers = {n for n in _tensors(store) if n.startswith("model.layers.")}
    assert torch.equal(model(ids), want)
    assert sum(hashed) == sum(store.nbytes(n) for n in layers)
    hashed.clear()
    assert torch.equal(model(ids), want)
    assert sum(hashed) == 0
    model.layers.release()


def test_porter_generate_rehash_reaches_runtime_load(artifact, monkeypatch):
    from click.testing import CliRunner

    from porter.cli import main as cli

    seen = []
    real = runtime.load
    monkeypatch.setattr(runtime, "load", lambda *a, **kw: seen.append(kw.get("rehash")) or real(*a, **kw))
    for args in ([], ["--rehash"]):
        res = CliRunner().invoke(
            cli, ["generate", str(artifact), "--prompt", "x", "--max-new-tokens", "1", *args]
        )
        assert res.exit_code == 0, res.output
    assert seen == [False, True]


def test_a_verified_artifact_loads_without_hashing(art, hashed):
    """porter verify's integrity hashes every artifact byte: the shards it finds whole are recorded, so the
    load that follows (a server started after the check) hashes nothing; a shard it finds changed is not."""
    from click.testing import CliRunner

    from porter.cli import main as cli

    res = CliRunner().invoke(cli, ["-q", "verify", str(art), "--prompt", "x", "--max-new-tokens", "0"])
    assert res.exit_code == 0, res.output
    hashed.clear()
    store = open_store(art, record_checks=True)
    _staged(store)
    assert sum(hashed) == 0
    name = max(sorted(_tensors(store)), key=store.nbytes)
    shard = _flip(store, name)
    store.checked.file.unlink()
    res = CliRunner().invoke(cli, ["-q", "verify", str(art), "--prompt", "x", "--max-new-tokens", "0"])
    assert res.exit_code == 1 and f"tensor {name} in shard {shard.name}: digest differs" in res.output
    rec = json.loads(store.checked.file.read_text())["shards"]
    assert sorted(rec) == sorted(f.name for f in art.glob("*.safetensors") if f != shard)


def test_hf_layout_records_its_per_expert_parts(tiny_vendor, tmp_path, hashed, monkeypatch):
    """--layout hf: the staged tensors are the per-expert parts the shards hold; they are what is recorded."""
    monkeypatch.setattr(checked, "RACY_NS", 0)
    art = tmp_path / "hf"
    porter.convert(tiny_vendor, art, progress=False, layout="hf")
    store = open_store(art, record_checks=True)
    assert store._hf is not None
    _same(_staged(store), _mapped(store))
    total = sum(hashed)
    hashed.clear()
    again = open_store(art, record_checks=True)
    _same(_staged(again), _mapped(again))
    assert total > 0 and sum(hashed) == 0
