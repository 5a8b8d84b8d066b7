"""porter convert end to end on tiny checkpoints built in code (docs/artifact-format.md)."""

import hashlib
import json
import math
import shutil
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from tensor_checks import chunked_digest, cuda_quantize_path_on_cpu, load_all, shard_digests
from tiny_checkpoint import build_tiny_checkpoint

import converters
import converters.minimax_m3 as m3
import porter
from porter.cli import main as cli
from porter.format import mxfp8
from porter.format.layout import scale_name
from porter.source.local import read_header

arch = converters.get("minimax_m3_vl")  # the MiniMax-M3 converter


@pytest.fixture(scope="module")
def converted(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "out"
    porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False)
    return out


def test_experts_equal_quantization_of_source(tiny_vendor, converted):
    src, dst = load_all(tiny_vendor), load_all(converted)
    cfg = arch.resolve_config(json.loads((tiny_vendor / "config.json").read_text()))
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe(layer):
            assert m3.experts_w13_name(layer) not in dst
            continue
        p = f"language_model.model.layers.{layer}.block_sparse_moe.experts."
        w13 = dst[m3.experts_w13_name(layer)]
        w13_s = dst[m3.experts_w13_name(layer).replace("w13_weight", "w13_weight_scale")]
        w2, w2_s = dst[m3.experts_w2_name(layer)], dst[m3.experts_w2_name(layer) + "_scale"]
        assert w13.dtype == torch.float8_e4m3fn and w13_s.dtype == torch.uint8
        assert tuple(w13.shape) == (8, 128, 64) and tuple(w13_s.shape) == (8, 128, 2)
        assert tuple(w2.shape) == (8, 64, 64) and tuple(w2_s.shape) == (8, 64, 2)
        for e in range(cfg.num_local_experts):
            gate_up = torch.cat([src[p + f"{e}.w1.weight"], src[p + f"{e}.w3.weight"]])  # [gate; up]
            q, s = mxfp8.quantize(gate_up)
            assert torch.equal(w13[e].view(torch.uint8), q.view(torch.uint8)) and torch.equal(w13_s[e], s)
            q, s = mxfp8.quantize(src[p + f"{e}.w2.weight"])
            assert torch.equal(w2[e].view(torch.uint8), q.view(torch.uint8)) and torch.equal(w2_s[e], s)


def test_unquantized_tensors_bit_identical(tiny_vendor, converted):
    src, dst = load_all(tiny_vendor), load_all(converted)
    carried = 0
    for name, t in src.items():
        if ".experts." in name:
            continue
        canon = arch.canonical_name(name) or name
        assert dst[canon].dtype == t.dtype, name
        assert dst[canon].view(torch.uint8).equal(t.view(torch.uint8)), name
        carried += 1
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in dst
    assert dst["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert carried == len([n for n in src if ".experts." not in n])


def test_index_manifest_and_shards_consistent(converted):
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    doc = json.loads((converted / "porter.json").read_text())
    shards = sorted(p.name for p in converted.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(doc["shards"])
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    assert set(index["weight_map"]) == set(doc["tensors"])
    assert not list(converted.glob("*.partial")) and not (converted / ".porter-journal.json").exists()
    assert doc["format_version"] == 2 and doc["digest"]["chunk_bytes"] == 16 << 20
    for f in shards:
        data = (converted / f).read_bytes()
        head, _, digest = shard_digests(converted / f)
        assert (head, digest) == (doc["shards"][f]["header_sha256"], doc["shards"][f]["digest"])
        assert len(data) == doc["shards"][f]["bytes"]
        assert len(data) <= 300_000 or doc["shards"][f]["tensors"] == 1
        header = read_header(converted / f)
        with safe_open(str(converted / f), "pt") as h:
            for name in h.keys():
                rec = doc["tensors"][name]
                assert index["weight_map"][name] == f == rec["shard"]
                t = h.get_tensor(name)
                assert list(t.shape) == rec["shape"] == header[name]["shape"]
                assert str(t.dtype).replace("torch.", "") == rec["dtype"]
                assert chunked_digest(t.contiguous().view(torch.uint8).numpy().tobytes()) == rec["digest"]
    w13 = doc["tensors"]["model.layers.2.block_sparse_moe.experts.w13_weight"]
    assert 0.005 < w13["rel_fro_error"] < 0.0625 and w13["max_abs_error"] > 0
    assert doc["architecture"] == "minimax_m3" and doc["activation"] == {
        "name": "swiglu_oai",
        "formula": "min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + beta)",
        "alpha": 1.702,
        "beta": 1.0,
        "limit": 7.0,
        "provenance": {
            "alpha": "config:text_config.swiglu_alpha",
            "beta": "default",
            "limit": "config:text_config.swiglu_limit",
        },
    }
    assert doc["layout"]["gate_up_order"] == "gate_up" and doc["layout"]["block_size"] == 32
    cfg = json.loads((converted / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "mxfp8" and qc["weight_block_size"] == [1, 32]
    assert "model.layers.1.block_sparse_moe.gate" in qc["ignored_layers"]
    assert "lm_head" in qc["ignored_layers"] and "model.layers.1.self_attn.q_proj" in qc["ignored_layers"]
    assert (converted / "tokenizer.json").read_bytes() == (
        Path(doc["source"]["path"]) / "tokenizer.json"
    ).read_bytes()


def test_both_layouts_convert_to_the_same_tensors(tiny_vendor, tiny_transformers, converted, tmp_path):
    porter.convert(tiny_transformers, tmp_path / "hf", progress=False)
    a, b = load_all(converted), load_all(tmp_path / "hf")
    text = [k for k in a if k.startswith(("model.", "lm_head."))]
    assert set(text) == set(b)
    for k in text:
        assert a[k].view(torch.uint8).equal(b[k].view(torch.uint8)), k


@pytest.mark.parametrize("how", ["flag", "config"])
def test_interleaved_gate_up_is_uninterleaved(tiny_transformers, tmp_path, how):
    marked = {"gate_up_interleaved": True} if how == "config" else None
    src = build_tiny_checkpoint(
        tmp_path / "inter", layout="transformers", gate_up="interleaved", text_overrides=marked
    )
    if how == "config":
        assert json.loads((src / "config.json").read_text())["gate_up_interleaved"] is True
    porter.convert(src, tmp_path / "a", gate_up="interleaved" if how == "flag" else "auto", progress=False)
    porter.convert(tiny_transformers, tmp_path / "b", progress=False)
    a, b = load_all(tmp_path / "a"), load_all(tmp_path / "b")
    name = m3.experts_w13_name(1)
    assert a[name].view(torch.uint8).equal(b[name].view(torch.uint8))
    if how == "flag":  # without the flag the interleaved rows would be taken as [gate; up]: different
        porter.convert(src, tmp_path / "c", progress=False)
        assert not load_all(tmp_path / "c")[name].view(torch.uint8).equal(b[name].view(torch.uint8))


def test_quantize_all_scope(tiny_vendor, tmp_path):
    porter.convert(tiny_vendor, tmp_path / "all", quantize="all", progress=False)
    dst = load_all(tmp_path / "all")
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.index_k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.2.block_sparse_moe.shared_experts.up_proj.weight",
    ]:
        assert dst[name].dtype == torch.float8_e4m3fn and scale_name(name) in dst, name
    for name in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.block_sparse_moe.gate.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.self_attn.index_q_norm.weight",
        "multi_modal_projector.linear_1.weight",
    ]:
        assert dst[name].dtype != torch.float8_e4m3fn and scale_name(name) not in dst, name


def test_quantize_none_keeps_everything_exact(tiny_vendor, tmp_path):
    porter.convert(tiny_vendor, tmp_path / "none", quantize="none", progress=False)
    src, dst = load_all(tiny_vendor), load_all(tmp_path / "none")
    w13 = dst[m3.experts_w13_name(3)]
    p = "language_model.model.layers.3.block_sparse_moe.experts."
    assert w13.dtype == torch.bfloat16
    assert torch.equal(w13[5], torch.cat([src[p + "5.w1.weight"], src[p + "5.w3.weight"]]))
    assert not any(k.endswith("_scale") for k in dst)


def test_dry_run_writes_nothing(tiny_vendor, tmp_path):
    out = tmp_path / "dry"
    res = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert not out.exists()
    plan = porter.convert(tiny_vendor, out, dry_run=True)
    assert plan["output_bytes"] > 0 and len(plan["quantized"]) == 6 and not out.exists()
    assert plan["peak_bytes_estimate"] > 0


def test_non_empty_output_refused_then_force(tiny_vendor, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out)])
    assert res.exit_code == 2 and "not empty" in res.output and str(out / "keep.txt") in res.output
    res = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out), "--force", "-q"])
    assert res.exit_code == 2 and "not written by porter" in res.output, res.output  # --force removes only
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "x"
    (out / "keep.txt").unlink()
    res = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out), "-q"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["convert", str(tiny_vendor), "--output", str(out), "--force", "-q"])
    assert res.exit_code == 0, res.output  # porter's own earlier output: replaced
    assert (out / "model.safetensors.index.json").exists()


def test_crash_then_resume_skips_finished_shards(tiny_vendor, tmp_path, monkeypatch, converted):
    import porter.engine.run as pp

    out = tmp_path / "r"
    real = pp.Pipeline._copy

    def dying(self, u):
        if u.index >= 60:
            raise RuntimeError("simulated crash")
        return real(self, u)

    monkeypatch.setattr(pp.Pipeline, "_copy", dying)
    with pytest.raises(RuntimeError, match="simulated crash"):
        porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False, workers=1)
    assert not (out / "model.safetensors.index.json").exists() and not (out / "porter.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    assert 0 < len(finished) < 4
    res = CliRunner().invoke(
        cli, ["convert", str(tiny_vendor), "--output", str(out), "--max-shard-size", "300KB"]
    )
    assert res.exit_code == 2 and "--resume" in res.output
    monkeypatch.setattr(pp.Pipeline, "_copy", real)
    porter.convert(tiny_vendor, out, max_shard_size="300KB", resume=True, progress=False)
    assert all((out / f).stat().st_mtime_ns == m for f, m in finished.items())  # not rewritten
    a, b = load_all(out), load_all(converted)
    assert set(a) == set(b) and all(a[k].view(torch.uint8).equal(b[k].view(torch.uint8)) for k in a)
    assert (
        json.loads((out / "porter.json").read_text())["tensors"]
        == json.loads((converted / "porter.json").read_text())["tensors"]
    )


def test_workers_do_not_change_a_byte(tiny_vendor, tmp_path, converted):
    """Shards, index, config and every per-tensor record are identical for 1 and 4 workers (and the
    module fixture's default); CPU statistics are summed in plan order."""
    runs = {}
    for w in (1, 4):
        porter.convert(
            tiny_vendor, tmp_path / f"w{w}", max_shard_size="300KB", progress=False, workers=w, device="cpu"
        )
        runs[w] = tmp_path / f"w{w}"
    for d in (runs[4], converted):
        assert_same_conversion(runs[1], d)


def assert_same_conversion(a: Path, b: Path) -> None:
    """The same file names, every file but porter.json byte-identical, and porter.json's tensor and shard
    records equal."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        if n != "porter.json":
            assert (a / n).read_bytes() == (b / n).read_bytes(), n
    ma, mb = (json.loads((x / "porter.json").read_text()) for x in (a, b))
    assert ma["tensors"] == mb["tensors"] and ma["shards"] == mb["shards"]


def _corrupt(src: Path, dst: Path, fn):
    shutil.copytree(src, dst)
    fn(dst)
    return dst


def _edit_source_shard(d: Path, name: str, fn) -> None:
    """Rewrite the source shard holding `name` after fn(tensors dict) edits it in place."""
    from safetensors.torch import save_file

    f = d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_all_file(f)
    fn(tensors)
    save_file(tensors, str(f))


def test_nan_weight_is_named_and_no_complete_output(tiny_vendor, tmp_path):
    name = "language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight"

    def poison(tensors):
        tensors[name][1, 2] = float("nan")

    src = _corrupt(tiny_vendor, tmp_path / "nan", lambda d: _edit_source_shard(d, name, poison))
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(tmp_path / "o")])
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if "porter: error" in line]
    assert len(errors) == 1 and "NaN" in errors[0], res.output
    assert (
        errors[0]
        .split("porter: error: ")[1]
        .startswith("language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight")
    )
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()


def load_all_file(f):
    with safe_open(str(f), "pt") as h:
        return {k: h.get_tensor(k).clone() for k in h.keys()}


def test_pickle_only_refused(tmp_path):
    d = tmp_path / "pkl"
    d.mkdir()
    build = build_tiny_checkpoint(tmp_path / "ok")
    shutil.copy(build / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    res = CliRunner().invoke(cli, ["convert", str(d), "--output", str(tmp_path / "o")])
    assert res.exit_code == 2 and "never unpickles" in res.output


def test_missing_tensor_and_bad_config_are_named(tiny_vendor, tmp_path):
    name = "language_model.model.layers.1.self_attn.index_q_proj.weight"
    src = _corrupt(
        tiny_vendor, tmp_path / "miss", lambda d: _edit_source_shard(d, name, lambda ts: ts.pop(name))
    )
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(tmp_path / "o")])
    assert res.exit_code == 2 and "index_q_proj" in res.output

    def bad(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["text_config"]["swiglu_limit"] = "seven"
        (d / "config.json").write_text(json.dumps(cfg))

    src = _corrupt(tiny_vendor, tmp_path / "bad", bad)
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "swiglu_limit" in res.output


def test_k_not_multiple_of_32_is_refused(tmp_path):
    src = build_tiny_checkpoint(tmp_path / "k", text_overrides={"intermediate_size": 48})
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(tmp_path / "o")])
    assert res.exit_code == 2 and "multiple of 32" in res.output


def test_hub_offline_cached_and_uncached(tiny_vendor, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--MiniMaxAI--Tiny-M3"
    shutil.copytree(tiny_vendor, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    out = tmp_path / "o"
    porter.convert("MiniMaxAI/Tiny-M3", out, progress=False)
    src = json.loads((out / "porter.json").read_text())["source"]
    assert src["repo_id"] == "MiniMaxAI/Tiny-M3" and src["commit"] == sha
    res = CliRunner().invoke(cli, ["convert", "MiniMaxAI/Not-Cached", "--output", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "not in the Hugging Face cache" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_hub_dry_run_reads_headers_only(tiny_vendor, tmp_path, monkeypatch):
    """--dry-run of a repo id fetches config/index/tokenizer and shard headers, never tensor data."""
    import huggingface_hub
    import huggingface_hub.constants as c
    from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo

    cache, sha = tmp_path / "hub", "fedcba9876543210fedcba9876543210fedcba98"
    snap = cache / "models--MiniMaxAI--Tiny-M3" / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in tiny_vendor.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, snap / f.name)
    (cache / "models--MiniMaxAI--Tiny-M3" / "refs").mkdir()
    (cache / "models--MiniMaxAI--Tiny-M3" / "refs" / "main").write_text(sha)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    asked = []

    def fake_metadata(repo_id, revision=None, **kw):
        asked.append((repo_id, revision))
        files = {}
        for f in sorted(tiny_vendor.glob("*.safetensors")):
            files[f.name] = SafetensorsFileMetadata(
                metadata={},
                tensors={
                    n: TensorInfo(dtype=h["dtype"], shape=h["shape"], data_offsets=tuple(h["data_offsets"]))
                    for n, h in read_header(f).items()
                },
            )
        return SafetensorsRepoMetadata(metadata=None, sharded=True, weight_map={}, files_metadata=files)

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", fake_metadata)
    plan = porter.convert("MiniMaxAI/Tiny-M3", tmp_path / "o", dry_run=True)
    assert asked == [("MiniMaxAI/Tiny-M3", sha)]
    local = porter.convert(tiny_vendor, tmp_path / "o2", dry_run=True)
    assert plan["output_bytes"] == local["output_bytes"] and plan["quantized"] == local["quantized"]
    assert not (tmp_path / "o").exists() and not list(snap.glob("*.safetensors"))


@pytest.mark.parametrize("layout", ["vendor", "transformers"])
def test_staging_slabs_do_not_change_a_byte(
    tiny_vendor, tiny_transformers, tmp_path, monkeypatch, converted, layout
):
    """The GPU path's per-worker staging slabs (reads land in a reused buffer, reset per unit), exercised on
    the CPU: the same bytes as reading into fresh tensors, with several workers reusing their slabs."""
    import porter.engine.run as pp

    real_run = pp.Pipeline.run

    def staged_run(self, units):
        self.slabs.pin = True  # read through the slabs (pinned only on CUDA)
        return real_run(self, units)

    monkeypatch.setattr(pp.Pipeline, "run", staged_run)
    src = tiny_vendor if layout == "vendor" else tiny_transformers
    porter.convert(src, tmp_path / "staged", max_shard_size="300KB", progress=False, workers=3, device="cpu")
    monkeypatch.setattr(pp.Pipeline, "run", real_run)
    want = converted
    if layout == "transformers":
        want = tmp_path / "plain"
        porter.convert(src, want, max_shard_size="300KB", progress=False, workers=3, device="cpu")
    for f in sorted(p.name for p in want.glob("*.safetensors")):
        assert (tmp_path / "staged" / f).read_bytes() == (want / f).read_bytes(), f


def test_gpu_quantize_path_contract_on_cpu(tiny_vendor, tmp_path, monkeypatch, converted):
    """The --device cuda code path (CudaQuantizer.quantize: stream, staged copies, stats gathered in one
    tensor) run on the CPU with the stream stubbed: the same shard bytes as the CPU path and the same
    per-tensor error records (to 1e-9 relative: the GPU path sums a whole tensor where the CPU path sums row
    chunks)."""
    cuda_quantize_path_on_cpu(monkeypatch)
    out = tmp_path / "gpu_path"
    porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False, workers=2, device="cpu")
    for f in sorted(p.name for p in converted.glob("*.safetensors")):
        assert (out / f).read_bytes() == (converted / f).read_bytes(), f
    want, got = (json.loads((d / "porter.json").read_text())["tensors"] for d in (converted, out))
    errs = [(n, r["rel_fro_error"], got[n]["rel_fro_error"]) for n, r in want.items() if "rel_fro_error" in r]
    assert errs and all(abs(a - b) <= 1e-9 * max(a, 1e-30) for _, a, b in errs), errs[:3]


@pytest.mark.parametrize("gate_up", ["uninterleaved", "interleaved"])
def test_builder_copies_is_found_from_the_builders_themselves(tiny_vendor, tiny_transformers, gate_up):
    """builder_copies: the vendor layout's w1 / w3 reads and an uninterleaved fused gate_up slice are handed on
    as read (no copy); uninterleaving a fused gate_up makes a new tensor, which the estimate then counts on
    top of the slab (src bytes of the unit)."""
    from porter.commands.convert import ConvertOptions, make_plan
    from porter.engine.units import builder_copies, quant_sizes, unit_costs
    from porter.source import open_source

    for src in (tiny_vendor, tiny_transformers):
        plan = make_plan(open_source(src), ConvertOptions(max_shard_size="300KB", gate_up=gate_up))
        meta = plan.source.stored_meta
        w13 = next(t for t in plan.tensors if t.name.endswith("w13_weight"))
        w2 = next(t for t in plan.tensors if t.name.endswith("w2_weight"))
        fused = src == tiny_transformers
        assert builder_copies(w13, meta) == (fused and gate_up == "interleaved")
        assert not builder_copies(w2, meta)
        src_bytes = w13.shape[1] * w13.shape[2] * w13.dtype.itemsize
        work, _ = unit_costs(w13, torch.device("cpu"), 1, meta)
        chunk = min(w13.shape[1] * w13.shape[2], quant_sizes(1)[0])
        assert work == 9 * chunk + (src_bytes if builder_copies(w13, meta) else 0)


def test_gpu_path_quantizes_on_the_cpu_only_until_the_cuda_context_is_ready():
    """--device cuda: a part that arrives before the CUDA init thread is done is quantized by the CPU path's
    C quantizer (the CPU path's row chunks and numbers) instead of waiting; once the context is ready, or for
    a part the C quantizer does not take (kept scale bytes), it goes to the GPU."""
    from porter.engine import run

    class GpuStandIn:
        ready, parts_on_cpu, names = threading.Event(), 0, []

        def count_cpu_part(self):
            self.parts_on_cpu += 1

        def quantize(self, w, name, keep=None):
            self.names.append(name)
            return "q", "s", {}

    p = run.Pipeline.__new__(run.Pipeline)
    p.device, p.rounding, p.quant_sizes, p.gpu = torch.device("cuda"), "rceil", (1 << 14, None), GpuStandIn()
    w = torch.randn(96, 512, generator=torch.Generator().manual_seed(0)).to(
        torch.bfloat16
    )  # 3 chunks of 32 rows
    got = list(p._quantize(w, "w"))
    assert [r for r, *_ in got] == [0, 32, 64] and p.gpu.parts_on_cpu == 1 and not p.gpu.names
    for r, q, s, err in got:
        q_ref, s_ref, err_ref = mxfp8.quantize_with_error(w[r : r + 32], "rceil", "w")
        assert q.view(torch.uint8).equal(q_ref.view(torch.uint8)) and s.equal(s_ref) and err == err_ref
    keep = torch.full((96, 16), 127, dtype=torch.uint8)
    assert list(p._quantize(w, "kept", keep)) == [(0, "q", "s", {})] and p.gpu.names == ["kept"]
    p.gpu.ready.set()
    assert list(p._quantize(w, "ready")) == [(0, "q", "s", {})] and p.gpu.names == ["kept", "ready"]
    assert p.gpu.parts_on_cpu == 1


@pytest.mark.gpu
@pytest.mark.parametrize("context_first", [False, True])
@pytest.mark.parametrize("quantize", ["experts", "all"])
def test_cuda_conversion_is_bit_identical_to_cpu(tmp_path, monkeypatch, quantize, context_first):
    """--device cuda (pinned async copies, one stream per worker) writes the very bytes of --device cpu: every
    shard file, hence every tensor, on a checkpoint with wide experts (CPU quantizes them in row chunks, the
    GPU whole) and with every linear quantized. context_first: the CUDA context is made before any unit
    starts, so every part goes through the GPU; else (the default) parts ready before it go the CPU way."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if context_first:
        from porter.engine.cuda import CudaQuantizer

        real_start = CudaQuantizer.start

        def start_and_wait(self):
            real_start(self)
            self.ready.wait()

        monkeypatch.setattr(CudaQuantizer, "start", start_and_wait)
    from tiny_checkpoint import synthetic_overrides

    src = build_tiny_checkpoint(
        tmp_path / "src", text_overrides=synthetic_overrides(3, hidden=1024, intermediate=2048, experts=4)
    )
    for dev in ("cpu", "cuda"):
        porter.convert(
            src, tmp_path / dev, quantize=quantize, max_shard_size="40MB", progress=False, device=dev
        )
    shards = sorted(p.name for p in (tmp_path / "cpu").glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(p.name for p in (tmp_path / "cuda").glob("*.safetensors"))
    cpu, gpu = load_all(tmp_path / "cpu"), load_all(tmp_path / "cuda")
    assert set(cpu) == set(gpu) and any(t.dtype == torch.float8_e4m3fn for t in cpu.values())
    for name in cpu:
        assert cpu[name].view(torch.uint8).equal(gpu[name].view(torch.uint8)), name
    for f in shards:
        assert (tmp_path / "cpu" / f).read_bytes() == (tmp_path / "cuda" / f).read_bytes(), f
    a, b = (json.loads((tmp_path / d / "porter.json").read_text())["tensors"] for d in ("cpu", "cuda"))
    for name, rec in a.items():  # error statistics: same math, other summation order on the GPU
        assert rec["digest"] == b[name]["digest"]
        if "rel_fro_error" in rec:
            assert rec["rel_fro_error"] == pytest.approx(b[name]["rel_fro_error"], rel=1e-6)
            assert rec["max_abs_error"] == b[name]["max_abs_error"]


def test_writeback_thread_sees_every_range(tiny_vendor, tmp_path, monkeypatch, converted):
    """Writeback started by a background thread: the same files and records, with several workers filling
    one shard at once; every range written is handed to the flusher and every descriptor it was given is
    closed."""
    import porter.engine.writer as pp

    flushed, closed, real_submit, real_close = [], [], pp.Writeback.submit, pp.Writeback.close
    monkeypatch.setattr(
        pp.Writeback, "submit", lambda self, fd, o, n: (flushed.append(n), real_submit(self, fd, o, n))
    )
    monkeypatch.setattr(pp.Writeback, "close", lambda self, fd: (closed.append(fd), real_close(self, fd)))
    out = tmp_path / "out"
    porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False, workers=3, device="cpu")
    assert_same_conversion(converted, out)
    shards = list(out.glob("*.safetensors"))
    data = sum(p.stat().st_size for p in shards) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in shards
    )
    assert (sum(flushed), len(closed)) == (data, len(shards))


def test_writeback_thread_holds_at_most_max_fds(tiny_vendor, tmp_path, monkeypatch, converted):
    """With the flusher's descriptor cap at 1 (as if the disk made it lag many shards behind), shards opened
    past it start their writeback inline: same bytes, and never more than 1 dup open at once."""
    import porter.engine.writer as pp

    monkeypatch.setattr(pp.Writeback, "MAX_FDS", 1)
    held, inline, real_open, real_start = [], [], pp.Writeback.open, pp.start_writeback
    monkeypatch.setattr(
        pp.Writeback, "open", lambda self, fd: (real_open(self, fd), held.append(len(self.fds)))[0]
    )
    monkeypatch.setattr(
        pp,
        "start_writeback",
        lambda fd, o, n: (inline.append(threading.current_thread().name), real_start(fd, o, n))[1],
    )
    out = tmp_path / "out"
    porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False, workers=3, device="cpu")
    for n in sorted(p.name for p in converted.iterdir()):
        if n != "porter.json":
            assert (out / n).read_bytes() == (converted / n).read_bytes(), n
    assert held and max(held) == 1 and len(list(out.glob("*.safetensors"))) > 1
    assert "porter-writeback" in inline  # the first shard's ranges: the flusher thread
    assert any(name.startswith("porter-convert") for name in inline)  # the rest: inline, by the workers


def test_zero_byte_tensors_convert(tiny_vendor, tmp_path):
    """Empty carried tensors (0 bytes; they share their offset with the next tensor) neither hang the
    chunked digests nor change a byte of the others."""
    from safetensors.torch import save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_vendor, src)
    save_file(
        {
            "vision_tower.empty_a": torch.zeros(0, 4, dtype=torch.bfloat16),
            "vision_tower.empty_b": torch.zeros(0),
        },
        str(src / "model-extra.safetensors"),
    )
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"] |= {
        "vision_tower.empty_a": "model-extra.safetensors",
        "vision_tower.empty_b": "model-extra.safetensors",
    }
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    porter.convert(src, tmp_path / "out", progress=False, workers=3)
    got = load_all(tmp_path / "out")
    assert tuple(got["vision_tower.empty_a"].shape) == (0, 4) and got["vision_tower.empty_b"].numel() == 0
    doc = json.loads((tmp_path / "out" / "porter.json").read_text())
    assert doc["tensors"]["vision_tower.empty_a"]["digest"] == hashlib.sha256(b"").hexdigest()  # no chunks
    # a shard cap so small that one shard holds only the two empty tensors: it completes as it opens
    porter.convert(src, tmp_path / "tiny-shards", progress=False, workers=2, max_shard_size="1KB")
    doc = json.loads((tmp_path / "tiny-shards" / "porter.json").read_text())
    by_shard: dict = {}
    for name, rec in doc["tensors"].items():
        by_shard.setdefault(rec["shard"], set()).add(name)
    assert {"vision_tower.empty_a", "vision_tower.empty_b"} in by_shard.values()
    a, b = load_all(tmp_path / "tiny-shards"), load_all(tmp_path / "out")
    assert set(a) == set(b) and all(a[k].view(torch.uint8).equal(b[k].view(torch.uint8)) for k in a)


def test_chunked_digests_at_any_chunk_size_and_worker_count(tiny_vendor, tmp_path, monkeypatch):
    """Digest chunks that straddle writes, experts and tensors, completed by any worker in any order: the
    digests equal the rule written out independently (tensor_checks), with 1 or 3 workers alike, and
    `porter verify`'s integrity step follows the chunk size porter.json records."""
    from porter.commands.verify.integrity import check_integrity
    from porter.format import safetensors_io

    monkeypatch.setattr(safetensors_io, "DIGEST_CHUNK_BYTES", 5000)  # divides no write, no tensor
    docs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False, workers=workers)
        doc = json.loads((out / "porter.json").read_text())
        assert doc["digest"]["chunk_bytes"] == 5000
        for f, rec in doc["shards"].items():
            head, tensors, digest = shard_digests(out / f, 5000)
            assert (head, digest) == (rec["header_sha256"], rec["digest"]), f
            assert {n: doc["tensors"][n]["digest"] for n in tensors} == tensors
        docs.append(doc)
    assert any(
        math.prod(r["shape"]) > 10 * 5000
        for r in docs[0]["tensors"].values()
        if r["dtype"] == "float8_e4m3fn"
    )  # a quantized tensor of more than 10 chunks
    assert docs[0]["shards"] == docs[1]["shards"] and docs[0]["tensors"] == docs[1]["tensors"]
    monkeypatch.undo()
    man = json.loads((tmp_path / "w3" / "porter.json").read_text())
    assert check_integrity(tmp_path / "w3", man).passed
    assert not check_integrity(
        tmp_path / "w3", man | {"digest": man["digest"] | {"chunk_bytes": 4096}}
    ).passed


def test_sha256_digests_same_bytes_and_verified(tiny_vendor, converted, tmp_path):
    """`--digest sha256` (a manifest meant to be signed) writes the same shards as the default xxh3-128 rule;
    porter.json records the rule, its digests equal the sha256 rule written out independently, `porter verify`
    follows the rule each manifest records, and --resume refuses to mix the two."""
    out = tmp_path / "sha"
    res = CliRunner().invoke(
        cli,
        [
            "convert",
            str(tiny_vendor),
            "--output",
            str(out),
            "--max-shard-size",
            "300KB",
            "--digest",
            "sha256",
            "-q",
        ],
    )
    assert res.exit_code == 0, res.output
    doc, ref = (json.loads((d / "porter.json").read_text()) for d in (out, converted))
    assert doc["digest"]["algorithm"] == "sha256-chunked" and ref["digest"]["algorithm"] == "xxh3-128-chunked"
    assert sorted(doc["shards"]) == sorted(ref["shards"])
    for f, rec in doc["shards"].items():
        assert (out / f).read_bytes() == (converted / f).read_bytes(), f
        head, tensors, digest = shard_digests(out / f, hash_name="sha256")
        assert (head, digest) == (rec["header_sha256"], rec["digest"]) and digest != ref["shards"][f][
            "digest"
        ]
        assert head == ref["shards"][f]["header_sha256"]  # the header digest is sha256 under both rules
        assert {n: doc["tensors"][n]["digest"] for n in tensors} == tensors
    from porter.commands.verify.integrity import check_integrity

    assert check_integrity(out, doc).passed and check_integrity(converted, ref).passed
    # the other rule's name on these digests: every shard is named as changed
    swapped = check_integrity(out, doc | {"digest": ref["digest"]})
    assert not swapped.passed and {f.shard for f in swapped.issues} >= set(doc["shards"])
    res = CliRunner().invoke(
        cli,
        ["convert", str(tiny_vendor), "--output", str(out), "--max-shard-size", "300KB", "--resume", "-q"],
    )  # default digest: another conversion than the one there
    assert (
        res.exit_code == 2
        and "--resume with --digest xxh3-128, but this output was made with --digest sha256" in res.output
    ), res.output
    res = CliRunner().invoke(
        cli,
        [
            "convert",
            str(tiny_vendor),
            "--output",
            str(out),
            "--max-shard-size",
            "300KB",
            "--resume",
            "--digest",
            "sha256",
        ],
    )
    assert res.exit_code == 0 and "already complete" in res.output, res.output


def test_verify_refuses_format_version_1_in_one_line(converted, tmp_path):
    art = tmp_path / "old"
    shutil.copytree(converted, art)
    man = json.loads((art / "porter.json").read_text())
    (art / "porter.json").write_text(json.dumps(man | {"format_version": 1}))
    res = CliRunner().invoke(cli, ["verify", str(art), "--max-new-tokens", "0"])
    assert res.exit_code == 2, res.output
    assert "porter.json format_version 1" in res.output and "reconvert" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "rule",
    [
        None,
        {"algorithm": "sha256", "chunk_bytes": 16},
        {"algorithm": "sha256-chunked", "chunk_bytes": 0},
        {"algorithm": "md5-chunked", "chunk_bytes": 1 << 24},
        {"algorithm": 7},
        {"algorithm": "sha256-chunked", "chunk_bytes": 1},
        {"algorithm": "sha256-chunked", "chunk_bytes": 1 << 40},
    ],
)
def test_verify_refuses_a_broken_digest_rule_in_one_line(converted, tmp_path, rule):
    art = tmp_path / "art"
    shutil.copytree(converted, art)
    man = json.loads((art / "porter.json").read_text())
    (art / "porter.json").write_text(json.dumps(man | {"digest": rule}))
    res = CliRunner().invoke(cli, ["verify", str(art), "--max-new-tokens", "0"])
    assert res.exit_code == 2 and "porter.json digest" in res.output and "reconvert" in res.output, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_verify_names_the_changed_tensor_and_the_changed_header(converted, tmp_path):
    """Chunked digests still pinpoint: a flipped data byte names its tensor, a changed header byte the header."""
    art = tmp_path / "art"
    shutil.copytree(converted, art)
    man = json.loads((art / "porter.json").read_text())
    w13 = m3.experts_w13_name(2)
    shard = art / man["tensors"][w13]["shard"]
    raw = bytearray(shard.read_bytes())
    info = read_header(shard)[w13]
    n = int.from_bytes(raw[:8], "little")
    raw[8 + n + info["data_offsets"][0] + 1000] ^= 1
    at = raw.index(b'"format":"pt"')  # a header byte outside every entry: only the header sha256 sees it
    raw[at + 10 : at + 12] = b"PT"
    shard.write_bytes(bytes(raw))
    from porter.commands.verify.integrity import check_integrity

    res = check_integrity(art, man)
    msgs = [f.message for f in res.issues]
    assert not res.passed and len(msgs) == 2, msgs
    assert msgs[0] == (
        f"tensor {w13} in shard {shard.name}: digest differs from porter.json "
        "(the data changed after conversion)"
    )
    assert msgs[1].startswith(f"shard {shard.name}: header sha256 ") and "(the header changed)" in msgs[1]


def test_max_memory_caps_the_workers_or_refuses_in_one_line(tiny_vendor, tmp_path, caplog, monkeypatch):
    """--max-memory that holds one worker's buffers but not eight's converts with fewer workers (same
    bytes, said in a warning); one that holds not even one worker's is refused before anything is written.
    The process's resident size is pinned: what else runs on the machine, or RSS moving between calls, does
    not move the estimates."""
    import logging

    from porter import engine
    from porter.commands.convert import ConvertOptions, make_plan
    from porter.engine import budget
    from porter.source import open_source

    pinned = {"RssAnon": 300 << 20, "RssFile": 100 << 20, "MemAvailable": 8 << 30, "MemTotal": 16 << 30}
    monkeypatch.setattr(budget, "memory_status", lambda: pinned)
    plan = make_plan(open_source(tiny_vendor), ConvertOptions(max_shard_size="300KB"))
    cpu = torch.device("cpu")
    need = {
        w: (lambda e: e["base"] + e["readback"] + e["unit"] + e["scales"])(
            engine.memory_estimate(plan.tensors, plan.source.stored_meta, w, cpu, 1 << 40)
        )
        for w in (1, 3, 8)
    }
    assert need[1] < need[3] < need[8]
    cap = (need[3] + need[8]) // 2  # room for 3 to 7 workers
    with caplog.at_level(logging.WARNING, logger="porter"):
        done = porter.convert(
            tiny_vendor,
            tmp_path / "capped",
            max_shard_size="300KB",
            progress=False,
            workers=8,
            max_memory=cap,
            device="cpu",
        )
    assert 1 <= done["workers"] < 8 and f"of 8 workers; converting with {done['workers']}" in caplog.text
    ref = tmp_path / "ref"
    porter.convert(tiny_vendor, ref, max_shard_size="300KB", progress=False, workers=1, device="cpu")
    for f in sorted(p.name for p in ref.glob("*.safetensors")):
        assert (tmp_path / "capped" / f).read_bytes() == (ref / f).read_bytes(), f
    res = CliRunner().invoke(
        cli,
        [
            "convert",
            str(tiny_vendor),
            "--output",
            str(tmp_path / "tiny"),
            "--max-memory",
            "10MB",
            "--device",
            "cpu",
        ],
    )
    assert res.exit_code == 2 and "--max-memory 0.01 GB is below what one unit of work needs" in res.output
    assert not (tmp_path / "tiny").exists()


def test_unit_costs_count_the_quantizer_that_runs_and_copies_once(tiny_vendor, monkeypatch):
    """A CPU unit's working set is its quantize call's: 9 bytes/element beside the results with the compiled
    C quantizer, 16 with the torch path (no C quantizer, or a source the C loop does not take);
    on the GPU path the same call's memory with its results (a part quantized on the CPU while the CUDA
    context starts); a copied range costs nothing beyond the worker's read slab it lives in."""
    from porter.commands.convert import ConvertOptions, make_plan
    from porter.format import mxfp8_native
    from porter.source import open_source

    plan = make_plan(open_source(tiny_vendor), ConvertOptions(max_shard_size="300KB"))
    from porter.engine.units import make_units, quant_sizes, unit_costs

    meta, cpu = plan.source.stored_meta, torch.device("cpu")
    t = next(x for x in plan.tensors if x.quantize and x.per_expert)
    elems = t.shape[1] * t.shape[2]
    for workers in (1, 3):
        chunk = min(elems, quant_sizes(workers)[0])
        out = chunk + chunk // 32
        assert mxfp8_native.function() is not None, mxfp8_native.reason()
        assert unit_costs(t, cpu, workers, meta) == (9 * chunk, out)
        assert unit_costs(t, cpu, workers, {}) == (16 * chunk + 2 * elems, out)  # sources unknown:
        # torch's bound and a builder copy of the bf16 expert
        with monkeypatch.context() as m:
            m.setattr(mxfp8_native, "function", lambda: None)  # no C quantizer: the torch path's bound
            assert unit_costs(t, cpu, workers, meta) == (16 * chunk, out)
    gpu = torch.device("cuda")  # unit_costs only reads device.type
    chunk = min(elems, quant_sizes(17)[0])
    assert unit_costs(t, gpu, 17, meta) == (10 * chunk + chunk // 32, 0)  # a part on the CPU at start
    units = make_units(plan.tensors, meta, lambda _: False, cpu, 3)
    copies = [u for u in units if u.kind == "copy"]
    assert copies and all(u.cost == 0 for u in copies)
    assert all(u.cost > 0 for u in units if u.kind == "expert" and u.t.quantize)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_units_interleave_over_a_few_shards_in_plan_order(width):
    """Every unit once; each shard's units in plan order; never more than `width` shards started and unfinished."""
    from porter.engine.units import interleave_shards

    sizes = {"a": 3, "b": 1, "c": 5, "d": 2, "e": 4}
    units = [(f, i) for f, n in sizes.items() for i in range(n)]
    order = interleave_shards(units, lambda u: u[0], width)
    assert sorted(order) == sorted(units)
    for f in sizes:
        assert [i for g, i in order if g == f] == list(range(sizes[f]))
    open_shards = []
    for k, (f, _) in enumerate(order):
        left = [g for g, _ in order[k:]]
        open_shards = {g for g, _ in order[: k + 1] if g in left[1:] or g == f}
        assert len(open_shards) <= width
    if width == 1:
        assert order == units


def test_compiled_and_torch_cpu_quantizers_write_the_same_bytes(
    tiny_vendor, tmp_path, monkeypatch, converted
):
    """The default CPU conversion quantizes with the compiled C loop (porter.format.mxfp8_native); without
    it the torch ops: every shard, the index and config byte-identical, the shard
    records equal, and each tensor's error record equal up to the order of the per-block fp32 sums (relative
    3.7e-6, docs/mxfp8.md; the maximum error identical)."""
    from porter.format import mxfp8_native

    assert mxfp8_native.function() is not None, mxfp8_native.reason()
    monkeypatch.setattr(mxfp8_native, "function", lambda: None)
    out = tmp_path / "torch"
    porter.convert(tiny_vendor, out, max_shard_size="300KB", progress=False, workers=2, device="cpu")
    for p in converted.iterdir():
        if p.name != "porter.json":
            assert p.read_bytes() == (out / p.name).read_bytes(), p.name
    native, torch_ops = (json.loads((d / "porter.json").read_text()) for d in (converted, out))
    assert native["shards"] == torch_ops["shards"]
    assert native["tensors"].keys() == torch_ops["tensors"].keys()
    quantized = 0
    for name, rec in native["tensors"].items():
        other = torch_ops["tensors"][name]
        assert {k: v for k, v in rec.items() if k != "rel_fro_error"} == {
            k: v for k, v in other.items() if k != "rel_fro_error"
        }, name
        if rec.get("rel_fro_error") is not None:
            quantized += 1
            assert math.isclose(rec["rel_fro_error"], other["rel_fro_error"], rel_tol=3.7e-6), name
    assert quantized > 0
