"""The staged loader (runtime/staging.py, ArtifactStore.stage) on the CPU: the bytes it hands out are the
mapped shards' bytes, its buffers are reused (host memory bounded by threads x buffer_bytes, whatever the
model's size), a truncated or changed shard is a LoadError naming it and nothing from it is handed out, and
its progress bar shows only when asked. The CUDA path: tests/test_load_gpu.py."""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import porter
import runtime
from porter.cli import main as cli
from porter.errors import LoadError
from porter.format.safetensors_io import file_digests, parse_header
from runtime import staging
from runtime.loader import ArtifactStore, open_store
from runtime.staging import DigestRule, Span, Staging

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("staging") / "art"
    porter.convert(tiny_vendor, out, progress=False, max_shard_size="300KB")  # several shards
    return out


@pytest.fixture(scope="module")
def hf_artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("staging-hf") / "art"
    porter.convert(tiny_vendor, out, progress=False, layout="hf")
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _mapped(store) -> dict:
    return {n: store.get(n).clone() for n in store.names() - store.carried_names()}


def _staged(store, **kw) -> dict:
    s = store.stage(lambda n: CPU, **kw)
    try:
        out = {n: store.get(n) for n in store.names() - store.carried_names()}
        s.finish()
    finally:
        store.unstage()
    return out


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(_bytes(a[n]), _bytes(b[n])), n


@pytest.mark.parametrize(
    "buffer_bytes, threads",
    [(staging.BUFFER_BYTES, 1), (4096, 3), (1000, 2)],  # one item; chunks cut into pieces of two sizes
)
def test_staged_bytes_equal_mapped_bytes(artifact, buffer_bytes, threads):
    store = open_store(artifact)
    assert len({store.files[n] for n in store.names()}) > 1
    _same(_staged(store, buffer_bytes=buffer_bytes, threads=threads), _mapped(store))


def test_hf_layout_stages_the_per_expert_parts(hf_artifact):
    store = open_store(hf_artifact)
    assert store._hf is not None
    _same(_staged(store, buffer_bytes=8192, threads=2), _mapped(store))


def _spans(art: Path, chunk: int) -> list:
    """Every tensor of the artifact's shards with its digest under a chunk of `chunk` bytes."""
    spans = []
    with ThreadPoolExecutor(2) as pool:
        for f in sorted(art.glob("*.safetensors")):
            start, header = parse_header(f)
            digests = file_digests(f, pool, chunk, "xxh3-128").tensors
            for name, info in header.items():
                b, e = info["data_offsets"]
                spans.append(Span(name, f, start + b, e - b, torch.uint8, (e - b,), CPU, digests[name]))
    return spans


@pytest.mark.parametrize("read_block", [staging.READ_BLOCK, 1000])  # chunks read in one call, or in several
def test_whole_chunks_hashed_as_read(artifact, monkeypatch, read_block):
    """Chunks smaller than the buffer: many items of whole chunks, every digest checked, buffers reused."""
    monkeypatch.setattr(staging, "READ_BLOCK", read_block)
    spans = _spans(artifact, 4096)
    made = []
    new = Staging._new_buffer
    monkeypatch.setattr(Staging, "_new_buffer", lambda self: made.append(self.buffer_bytes) or new(self))
    s = Staging(spans, DigestRule(4096, "xxh3-128"), threads=3, buffer_bytes=3 * 4096).start()
    got = {sp.name: s.take(sp.name).clone() for sp in spans}
    s.finish()
    for sp in spans:
        with open(sp.path, "rb") as f:
            f.seek(sp.offset)
            assert got[sp.name].numpy().tobytes() == f.read(sp.nbytes), sp.name
    total = sum(sp.nbytes for sp in spans)
    assert len(s._items) > 10 * 3 and total > 20 * 3 * 4096  # many stages per buffer
    assert made == [3 * 4096] * len(made) and 1 <= len(made) <= 3  # one buffer per thread, reused


def _data_offset(shard: Path, name: str) -> int:
    start, header = parse_header(shard)
    return start + header[name]["data_offsets"][0]


def _copy(art: Path, tmp: Path) -> Path:
    d = tmp / "copy"
    shutil.copytree(art, d)
    return d


def _big_tensor(store) -> tuple[str, Path]:
    name = max(sorted(store.names() - store.carried_names()), key=store.nbytes)
    return name, store.files[name]


@pytest.mark.parametrize("buffer_bytes", [4096, 1000, staging.BUFFER_BYTES])
def test_changed_byte_is_named_and_nothing_is_handed_out(artifact, tmp_path, buffer_bytes):
    d = _copy(artifact, tmp_path)
    store = open_store(d)
    name, shard = _big_tensor(store)
    at = _data_offset(shard, name) + store.nbytes(name) - 1  # the tensor's last byte
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    s = store.stage(lambda n: CPU, buffer_bytes=buffer_bytes, threads=2)
    with pytest.raises(LoadError) as e:
        for n in sorted(store.names() - store.carried_names()):
            store.get(n)
        s.finish()
    msg = str(e.value)
    assert str(shard) in msg and repr(name) in msg and "porter.json" in msg and "\n" not in msg
    with pytest.raises(LoadError):  # the staging stays failed: nothing more comes out of it
        s.finish()
    store.unstage()


def test_failure_of_a_tensor_never_taken_fails_finish(artifact, tmp_path):
    """No partial model: the build may not ask for a tensor at all, yet its shard's fault is raised."""
    d = _copy(artifact, tmp_path)
    store = open_store(d)
    name, shard = _big_tensor(store)
    with open(shard, "r+b") as f:
        f.seek(_data_offset(shard, name))
        b = f.read(1)
        f.seek(_data_offset(shard, name))
        f.write(bytes([b[0] ^ 0x80]))
    s = store.stage(lambda n: CPU, buffer_bytes=4096, threads=2)
    with pytest.raises(LoadError, match=repr(name)):
        s.finish()
    store.unstage()


def test_truncated_shard_is_named(artifact, tmp_path):
    d = _copy(artifact, tmp_path)
    store = open_store(d)  # headers checked here, then the file is cut
    name, shard = _big_tensor(store)
    start, header = parse_header(shard)  # for the second half: every tensor, from the intact header
    spans = []
    for n, info in header.items():
        b, e = info["data_offsets"]
        spans.append(Span(n, shard, start + b, e - b, torch.uint8, (e - b,), CPU))
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(LoadError) as e:
        store.stage(lambda n: CPU)
    assert str(shard) in str(e.value) and "porter.json" in str(e.value)
    # cut while being read (the size check passed before): the read names the file
    s = Staging(spans, None, threads=2, buffer_bytes=4096).start()
    with pytest.raises(LoadError) as e:
        s.finish()
    assert str(shard) in str(e.value) and "truncated" in str(e.value)


def test_changed_header_is_named(artifact, tmp_path):
    d = _copy(artifact, tmp_path)
    man = json.loads((d / "porter.json").read_text())
    shard = sorted(man["shards"])[0]
    man["shards"][shard]["header_sha256"] = "0" * 64
    (d / "porter.json").write_text(json.dumps(man))
    with pytest.raises(LoadError, match=f"{shard}: header differs"):
        open_store(d).stage(lambda n: CPU)


def test_staging_without_digests_still_loads(artifact, tmp_path, caplog):
    d = _copy(artifact, tmp_path)
    man = json.loads((d / "porter.json").read_text())
    man.pop("digest")
    (d / "porter.json").write_text(json.dumps(man))
    store = open_store(d)
    _same(_staged(store, buffer_bytes=4096), _mapped(store))
    assert "no digest rule" in caplog.text


class _Item:
    def __init__(self, dev, n):
        self.device, self.length = dev, n


def test_devices_are_fed_together():
    """Two devices' items interleave in proportion to their bytes (a device_map's GPUs load at once)."""
    a = [_Item("a", 10) for _ in range(4)]
    b = [_Item("b", 5) for _ in range(8)]
    order = [i.device for i in staging._interleave([a, b])]
    assert sorted(order) == ["a"] * 4 + ["b"] * 8
    assert order[:6] == ["a", "b", "b", "a", "b", "b"]


def test_progress_bar_only_when_asked(artifact, capsys):
    store = open_store(artifact)
    # stderr may carry log lines when an earlier test configured logging: look for the bar itself (tqdm's
    # percentage), which no log line prints
    _staged(store)
    assert "100%" not in capsys.readouterr().err
    _staged(store, progress=True)
    err = capsys.readouterr().err
    assert "load" in err and "B/s" in err and "100%" in err
    runtime.load(artifact)  # library use: quiet
    assert "100%" not in capsys.readouterr().err


def test_generate_shows_the_load_bar_unless_quiet(artifact, monkeypatch):
    seen = []
    real = runtime.load
    monkeypatch.setattr(runtime, "load", lambda *a, **kw: seen.append(kw.get("progress")) or real(*a, **kw))
    for args in ([], ["-q"]):
        res = CliRunner().invoke(
            cli, ["generate", str(artifact), "--prompt", "x", "--max-new-tokens", "1", *args]
        )
        assert res.exit_code == 0, res.output
    assert seen == [True, False]


def test_store_api_keeps_working_after_staging(artifact):
    store = open_store(artifact)
    assert isinstance(store, ArtifactStore)
    _staged(store, buffer_bytes=4096)
    name = next(iter(store.names() - store.carried_names()))
    assert store.get(name).device == CPU  # mapped again once unstaged


def test_layer_streaming_from_staged_reads(artifact):
    """lazy=True's staged builder (LazyLayers.stream_from; runtime.load uses it on a GPU, here on the CPU):
    each layer read through a Staging, the next one read ahead, the logits those of the mapped model."""
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    want = runtime.load(artifact)(ids)
    store = open_store(artifact)
    model = runtime.load(store, lazy=True)
    model.layers.stream_from(store, CPU)
    built = []
    real = store.stage
    store.stage = lambda device_of, **kw: (
        built.append(sorted({n for n in store.names() if device_of(n)})) or real(device_of, **kw)
    )
    for _ in range(2):  # the second pass starts again at layer 0: the read-ahead of the last layer is dropped
        assert torch.equal(model(ids), want)
    n = model.cfg.num_hidden_layers
    assert len(built) == 2 * n and all(
        b and {f"model.layers.{i % n}." in x for x in b} == {True} for i, b in enumerate(built)
    )
    assert store._stagings == []  # nothing read ahead past the last layer
    model.layers[1]  # layer 2 is read ahead now; release() stops it
    assert len(store._stagings) == 1
    model.layers.free()  # the resident layer goes now (a streamed verify's pass, per layer); the read-ahead stays
    assert model.layers.resident() == [] and len(store._stagings) == 1
    assert model.layers[2] is not None and len(store._stagings) == 1  # layer 2 from its read-ahead, 3 ahead
    model.layers.release()
    assert store._stagings == []


def test_layer_streaming_names_a_changed_layer(artifact, tmp_path):
    d = _copy(artifact, tmp_path)
    store = open_store(d)
    name, shard = _big_tensor(store)
    at = _data_offset(shard, name)
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 4]))
    model = runtime.load(store, lazy=True)
    model.layers.stream_from(store, CPU)
    with pytest.raises(LoadError, match=repr(name)):
        model(torch.tensor([[5, 9, 13]]))
    model.layers.release()


@pytest.mark.parametrize("tamper", [False, True])
def test_exact_pass_reading_layers_ahead_equals_reading_the_mapped_shards(
    tiny_vendor, tmp_path, monkeypatch, tamper
):
    """verify's exact pass with each layer's source and artifact tensors staged ahead (what it does on a
    GPU; here onto the CPU) reports what it reports reading the mapped shards, tampering found the same."""
    from verify_tamper import copy_artifact, rewrite_tensor, shift_scales

    from porter.commands.verify import exact
    from porter.commands.verify.mapping import ArtifactReader, Mapping, SourceShards

    art = tmp_path / "art"
    porter.convert(tiny_vendor, art, progress=False)
    if tamper:
        art = copy_artifact(art, tmp_path / "t")
        rewrite_tensor(
            art, "model.layers.2.block_sparse_moe.experts.w13_weight_scale", shift_scales(+1, expert=3)
        )
    man = json.loads((art / "porter.json").read_text())

    def run():
        reader, shards = ArtifactReader(art, man), SourceShards(tiny_vendor)
        res = exact.rederive(reader, Mapping(shards), man["options"]["scale_rounding"], CPU)
        return res, reader, shards

    plain, _, _ = run()
    staged = []
    real = exact._ReadAhead._stage
    monkeypatch.setattr(exact, "reads_ahead", lambda device: True)
    monkeypatch.setattr(exact._ReadAhead, "_stage", lambda self, g: staged.append(g) or real(self, g))
    ahead, reader, shards = run()
    assert staged == list(range(len(staged))) and len(staged) > 4  # every group, in order
    assert reader.stagings == [] and shards.stagings == []  # each layer left the device after its turn
    assert ahead.passed == plain.passed == (not tamper)
    for a, b in zip(plain.tensors, ahead.tensors):
        assert (
            a.tensor,
            a.blocks,
            a.mismatched,
            a.scale_mismatched,
            a.mismatched_by_expert,
            a.first_mismatch,
        ) == (
            b.tensor,
            b.blocks,
            b.mismatched,
            b.scale_mismatched,
            b.mismatched_by_expert,
            b.first_mismatch,
        )
        assert a.weight_error == b.weight_error


def test_verify_projects_its_reads_first_and_passes_progress_to_its_loads(
    artifact, tiny_vendor, monkeypatch, caplog
):
    import logging

    seen = []
    real = runtime.load
    monkeypatch.setattr(runtime, "load", lambda *a, **kw: seen.append(kw.get("progress")) or real(*a, **kw))
    with caplog.at_level(logging.INFO, logger="porter"):
        res = porter.verify(artifact, reference=tiny_vendor, max_new_tokens=0, progress=True)
    assert res.passed and seen and all(seen)
    lines = [r.getMessage() for r in caplog.records]
    first = next(i for i, m in enumerate(lines) if "reads ~" in m and "in all" in m)
    assert first < next(i for i, m in enumerate(lines) if "exact re-derivation" in m)
    art_gb = sum(f.stat().st_size for f in artifact.glob("*.safetensors")) / 1e9
    assert f"artifact {art_gb:.1f} GB" in lines[first]


@pytest.mark.parametrize("streaming", [False, True])
def test_reference_models_reading_layers_ahead_equal_reading_the_mapped_shards(
    tiny_vendor, tmp_path, monkeypatch, streaming
):
    """verify's bf16 and rounded references built from each layer's tensors staged ahead (what verify does
    on a GPU; here onto the CPU) compute what they compute from the mapped shards, resident or layer-
    streamed; every group staged leaves the device again."""
    from porter.commands.verify import exact, mapping

    art = tmp_path / "art"
    porter.convert(tiny_vendor, art, progress=False)
    figures = lambda r: (
        [(x.cosine, x.rel_error, x.layer_error, x.faith_error) for x in r.layers],
        r.logits,
        r.faithfulness,
    )
    kw = dict(reference=tiny_vendor, max_new_tokens=0, numerics="both", streaming=streaming)
    plain = porter.verify(art, **kw).report
    staged, left = [], []
    real_stage, real_leave = mapping.GroupReadAhead._stage, mapping.GroupReadAhead._leave
    monkeypatch.setattr(exact, "reads_ahead", lambda device: True)
    monkeypatch.setattr(
        mapping.GroupReadAhead, "_stage", lambda self, k: staged.append((id(self), k)) or real_stage(self, k)
    )
    monkeypatch.setattr(
        mapping.GroupReadAhead,
        "_leave",
        lambda self, k: (left.append((id(self), k)) if k in self.staged else None) or real_leave(self, k),
    )
    ahead = porter.verify(art, **kw).report
    assert ahead.passed and plain.passed
    assert figures(ahead) == figures(plain)
    layers = {k for _, k in staged}
    assert layers == {None, *range(ahead.layers[-1].layer + 1)}  # every layer and the top tensors
    assert sorted(staged, key=str) == sorted(left, key=str)  # each staged group left the device


def test_reference_read_ahead_leaves_room_for_what_is_derived(tiny_vendor, monkeypatch):
    """A group is read ahead onto a GPU only when its bytes, the stacked copies derived from them and those
    still to come from the group before fit beside the reserve; else the store reads the mapped shards."""
    from porter.commands.verify import mapping

    shards = mapping.SourceShards(tiny_vendor)
    name = next(n for n in shards.meta if "experts" in n)
    ahead = mapping.GroupReadAhead({1: ({name}, set())}, shards, None, torch.device("cuda"))
    need = shards.nbytes(name)
    free = [0]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 1 << 40))
    for pending in (0, 12345):
        free[0] = pending + 2 * need + mapping.READ_AHEAD_RESERVE
        assert ahead._room(1, pending)
        free[0] -= 1
        assert not ahead._room(1, pending)
