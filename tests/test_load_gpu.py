"""runtime.load onto a GPU through the staged loader (runtime/staging.py; run on the H200, skipped on CPU CI):
the bytes on the device are the shards' bytes, the model computes what the CPU model computes, a changed or
truncated shard is a LoadError naming it (exit 2 from the CLI) and no model, a second load of unchanged
shards hashes nothing, the progress bar shows only when asked, and a device_map over two GPUs (where there are
two) equals one GPU."""

import shutil

import pytest
import torch
from click.testing import CliRunner

import porter
import runtime
from porter.cli import main as cli
from porter.errors import LoadError
from porter.format import checked
from porter.format.digest import CHUNK_HASHES
from porter.format.safetensors_io import parse_header
from runtime.loader import open_store

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("load-gpu") / "art"
    porter.convert(tiny_vendor, out, progress=False, max_shard_size="300KB")
    return out


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("buffer_bytes", [1000, 4096, 32 << 20])
def test_staged_cuda_bytes_equal_the_shards(artifact, buffer_bytes):
    store = open_store(artifact)
    names = store.names() - store.carried_names()
    mapped = {n: store.get(n).clone() for n in names}
    s = store.stage(lambda n: CUDA, buffer_bytes=buffer_bytes, threads=3)
    got = {n: store.get(n) for n in names}
    s.finish()
    store.unstage()
    for n in names:
        assert got[n].device == CUDA and got[n].dtype == mapped[n].dtype and got[n].shape == mapped[n].shape
        assert torch.equal(_bytes(got[n]).cpu(), _bytes(mapped[n])), n


def test_cuda_load_computes_what_the_cpu_model_does(artifact):
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = runtime.load(artifact, device="cpu")(ids)
    out = runtime.load(artifact, device="cuda", dtype=torch.float32, backend="torch")(ids.cuda()).cpu()
    assert float((out - ref).norm() / ref.norm()) <= 1e-5


def _tampered(artifact, tmp_path, how: str):
    d = tmp_path / "art"
    shutil.copytree(artifact, d)
    store = open_store(d)
    name = max(sorted(store.names() - store.carried_names()), key=store.nbytes)
    shard = store.files[name]
    start, header = parse_header(shard)
    if how == "changed":
        at = start + header[name]["data_offsets"][0] + 5
        with open(shard, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x10]))
    else:
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 64)
    return d, shard, name


@pytest.mark.parametrize("how", ["changed", "truncated"])
def test_changed_or_truncated_shard_is_named_and_no_model(artifact, tmp_path, how):
    d, shard, name = _tampered(artifact, tmp_path, how)
    with pytest.raises(LoadError) as e:
        runtime.load(d, device="cuda")
    assert shard.name in str(e.value) and "\n" not in str(e.value)
    if how == "changed":
        assert repr(name) in str(e.value)
    res = CliRunner().invoke(cli, ["generate", str(d), "--prompt", "x", "--device", "cuda"])
    assert res.exit_code == 2 and shard.name in res.output


def test_a_second_cuda_load_hashes_nothing_until_a_shard_changes(artifact, tmp_path, monkeypatch):
    """runtime.load records what it checked (porter/format/checked.py): the second load of the unchanged
    files hashes no byte and computes the same logits; a byte changed after that is named."""
    monkeypatch.setattr(checked, "RACY_NS", 0)  # the copy was written a moment ago
    d = tmp_path / "art"
    shutil.copytree(artifact, d)
    fed = []
    real = CHUNK_HASHES["xxh3-128"]
    monkeypatch.setitem(CHUNK_HASHES, "xxh3-128", lambda: fed.append(1) or real())
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(5)).cuda()
    first = runtime.load(d, device="cuda", dtype=torch.float32, backend="torch")(ids)
    assert len(fed) > 0
    fed.clear()
    second = runtime.load(d, device="cuda", dtype=torch.float32, backend="torch")(ids)
    assert len(fed) == 0 and torch.equal(first, second)
    store = open_store(d)
    name = max(sorted(store.names() - store.carried_names()), key=store.nbytes)
    shard = store.files[name]
    at = parse_header(shard)[0] + parse_header(shard)[1][name]["data_offsets"][0]
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(LoadError, match=repr(name)):
        runtime.load(d, device="cuda")


def test_progress_bar_on_cuda_only_when_asked(artifact, capfd):
    runtime.load(artifact, device="cuda")
    assert "100%" not in capfd.readouterr().err  # the bar's percentage; the loader's INFO line may be logged
    runtime.load(artifact, device="cuda", progress=True)
    err = capfd.readouterr().err
    assert "load" in err and "B/s" in err and "100%" in err
    res = CliRunner().invoke(cli, ["generate", str(artifact), "--prompt", "x", "--max-new-tokens", "1"])
    assert res.exit_code == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_map_over_two_gpus_equals_one(artifact):
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(4))
    one = runtime.load(artifact, device="cuda", dtype=torch.float32, backend="torch")(ids.cuda()).cpu()
    n = open_store(artifact).config.num_hidden_layers
    split = {f"layers.{i}": f"cuda:{int(i >= n // 2)}" for i in range(n)}
    model = runtime.load(artifact, device_map=split, dtype=torch.float32, backend="torch")
    assert {str(d) for d in model.layer_devices} == {"cuda:0", "cuda:1"}
    assert torch.equal(model(ids.cuda()).cpu(), one)


def test_layer_streaming_on_cuda_reads_ahead_and_matches(artifact):
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(5)).cuda()
    want = runtime.load(artifact, device="cuda", dtype=torch.float32, backend="torch")(ids)
    store = open_store(artifact)
    model = runtime.load(store, device="cuda", dtype=torch.float32, backend="torch", lazy=True)
    for _ in range(2):
        got = model(ids)
        assert float((got - want).norm() / want.norm()) <= 1e-6
    model.layers[0]
    assert len(store._stagings) == 1  # layer 1 being read while layer 0 is in use
    model.layers.release()
    assert store._stagings == []
