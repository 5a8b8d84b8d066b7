"""`porter verify`: a faithful conversion passes; tampered artifacts fail naming the layer or the tensor,
expert and shard; bad input exits 2; layer streaming equals the full run in a fraction of the memory.

Tampering (tests/verify_tamper.py) rewrites one tensor in place in its shard; `reseal=True` also fixes
porter.json (tensor and shard sha256) so integrity passes and only the comparison with the reference
(the exact re-derivation, then the numerics) can catch it. Planted converter bugs: test_verify_mapping.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from verify_tamper import (
    copy_artifact,
    edit_config,
    flip_byte,
    nudge_e4m3,
    rewrite_tensor,
    shift_scales,
    swap_gate_up,
    zero_scales,
)

import porter
from porter.cli import main
from porter.commands.verify import DEFAULT_PROMPT, Thresholds, verify
from porter.format.layout import layer_of

ROOT = Path(__file__).resolve().parents[1]
LAYER = 2  # the tampered MoE layer (layers 1-3 are MoE in the tiny checkpoint)
W13 = f"model.layers.{LAYER}.block_sparse_moe.experts.w13_weight"
EXPERT = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "art"
    porter.convert(tiny_vendor, out, progress=False)
    return out


def cli(*args):
    res = CliRunner().invoke(main, ["-q", "verify", *map(str, args)])
    if res.exception and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res


def tampered(artifact: Path, tmp_path: Path) -> Path:
    return copy_artifact(artifact, tmp_path / "art")


# ---------------------------------------------------------------------------------------------------
# A faithful conversion


def test_faithful_conversion_passes(artifact, tmp_path):
    report, plot = tmp_path / "r.json", tmp_path / "r.svg"
    res = cli(artifact, "--report", report, "--plot", plot, "--max-new-tokens", 4)
    assert res.exit_code == 0, res.output
    assert "verdict: PASS" in res.output and "integrity: ok" in res.output
    assert "sparse/moe" in res.output  # per-layer table rows
    rep = json.loads(report.read_text())
    assert rep["verdict"] == "pass" and rep["passed"] and rep["failing_layer"] is None
    assert rep["integrity"]["passed"] and rep["integrity"]["issues"] == []
    ex = rep["exact"]
    assert (
        ex["passed"]
        and ex["layout"] == "vendor"
        and ex["rounding"] == "rceil"
        and ex["unmapped_sources"] == []
    )
    quantized = [t for t in ex["tensors"] if t["quantized"]]
    assert len(quantized) == 6 and all(
        t["mismatched"] == 0 and t["units"] == 8 for t in quantized
    )  # 3 layers x 2
    # every 32-block of every expert compared: w13 [8, 128, 64] and w2 [8, 64, 64] -> 8*128*2 and 8*64*2 blocks
    assert sorted({t["blocks"] for t in quantized}) == [8 * 64 * 2, 8 * 128 * 2]
    assert all(0.02 < t["weight_error"] < 0.035 for t in quantized)  # rceil MXFP8: ~2.7 % rms
    carried = [t for t in ex["tensors"] if not t["quantized"]]
    assert any(t["tensor"].startswith("vision_tower.") for t in carried)
    assert all(t["mismatched"] == 0 and t["blocks"] > 0 for t in carried)
    assert [r["layer"] for r in rep["layers"]] == [0, 1, 2, 3]
    for r in rep["layers"]:
        assert {"cosine", "rel_error", "layer_error", "weight_error", "worst_tensor", "kind"} <= set(r)
        assert r["weight_error"] < 0.06 and r["cosine"] > 0.9
        # the same MXFP8 bytes in both models, the same float32 ops on the CPU: no difference at all
        assert r["faith_error"] == 0.0 and 0 < r["faith_limit"] < 1e-6
    assert rep["layers"][0]["weight_error"] == 0.0  # dense layer: nothing quantized, bit-identical
    assert set(rep["logits"]) >= {"kl", "top1", "top5", "max_abs_diff"}
    gen = rep["generation"][0]
    assert {
        "reference_text",
        "converted_text",
        "first_divergence",
        "converted_tokens",
        "reference_argmax",
        "kl",
        "top1",
    } <= set(gen)
    assert len(gen["converted_tokens"]) == len(gen["kl"]) == len(gen["reference_argmax"]) == 4
    assert rep["prompts"] == [DEFAULT_PROMPT]
    assert rep["thresholds"] == vars(Thresholds())
    root = ET.parse(plot).getroot()
    assert root.tag.endswith("svg") and "polyline" in plot.read_text()
    assert "PASS; bytes identical to the re-derivation" in plot.read_text()


def test_unquantized_conversion_is_exact(tiny_vendor, tmp_path):
    out = tmp_path / "none"
    porter.convert(tiny_vendor, out, quantize="none", progress=False)
    res = verify(out, max_new_tokens=3)
    assert res.passed, res.report.summary
    assert not any(t.quantized for t in res.report.exact.tensors) and res.report.exact.passed
    assert all(r.layer_error == 0 and r.weight_error == 0 for r in res.report.layers)
    assert res.report.logits.kl == 0 and res.report.generation[0].first_divergence is None
    assert res.report.generation[0].kl == [0.0, 0.0, 0.0]


def test_threshold_flags_override(artifact):
    res = cli(artifact, "--max-weight-error", 0.01, "--max-new-tokens", 0)
    assert res.exit_code == 1
    assert "layer 1: tensor model.layers.1.block_sparse_moe.experts." in res.output  # first quantized layer
    assert "FAIL  <- first failing layer" in res.output


# ---------------------------------------------------------------------------------------------------
# Tampered artifacts: the right layer / tensor is named


def test_scales_shifted_resealed_caught_by_bytes_and_numerics(artifact, tmp_path):
    art = tampered(artifact, tmp_path)
    rewrite_tensor(art, W13 + "_scale", shift_scales(+1), reseal=True)
    res = verify(art, max_new_tokens=0)
    rep = res.report
    assert rep.integrity.passed  # re-sealed: only the comparison with the reference can see it
    assert not res.passed and res.failing_layer == LAYER
    checks = {(f.check, f.layer) for f in res.failures}
    assert ("exact", LAYER) in checks and ("weights", LAYER) in checks and ("faithfulness", LAYER) in checks
    assert all(f.layer in (None, LAYER) for f in res.failures)  # each layer runs alone: nothing else blamed
    ex = next(f for f in res.failures if f.check == "exact")
    assert (
        ex.tensor == W13
        and ex.shard == json.loads((art / "porter.json").read_text())["tensors"][W13]["shard"]
    )
    blocks = 8 * 128 * 2  # every non-zero block of every expert moved
    assert (
        f"{blocks} of {blocks} 32-block(s) differ from the re-derivation ({blocks} with a different scale byte)"
        in ex.message
    )
    bad = rep.layers[LAYER]
    assert bad.faith_error > 0.1 and bad.faith_error / bad.faith_limit > 1e5  # the layer's update moved ~all
    assert all(r.faith_error == 0.0 for r in rep.layers if r.layer != LAYER)


def test_one_element_off_by_one_ulp_named_to_the_block(artifact, tmp_path):
    """Invisible to the statistics (weight error moves by ~1e-4), caught as exactly one 32-block."""
    art = tampered(artifact, tmp_path)
    rewrite_tensor(art, W13, nudge_e4m3(EXPERT, 70, 37))  # one e4m3 ulp (never NaN)
    res = verify(art, max_new_tokens=0)
    (ex,) = [f for f in res.failures if f.check == "exact"]
    assert not res.passed and ex.tensor == W13 and ex.expert == EXPERT and ex.value == 1
    assert f"first at expert {EXPERT}, row 70, block 1 (elements 32..63)" in ex.message
    assert not any(f.check == "weights" for f in res.failures)  # the second opinion alone would pass it


def test_scales_shifted_checksum_mismatch(artifact, tmp_path):
    art = tampered(artifact, tmp_path)
    rewrite_tensor(art, W13 + "_scale", shift_scales(+1), reseal=False)
    res = cli(art, "--max-new-tokens", 0)
    assert res.exit_code == 1
    assert f"tensor {W13}_scale in shard model-00001-of-00001.safetensors: digest differs" in res.output
    assert "integrity: FAILED" in res.output


def test_gate_up_swapped_in_one_expert(artifact, tmp_path):
    art = tampered(artifact, tmp_path)
    rewrite_tensor(art, W13, swap_gate_up(EXPERT))
    rewrite_tensor(art, W13 + "_scale", swap_gate_up(EXPERT))
    res = verify(art, max_new_tokens=0)
    assert res.report.integrity.passed and not res.passed
    assert res.failing_layer == LAYER
    ex = next(f for f in res.failures if f.check == "exact")
    assert ex.tensor == W13 and ex.expert == EXPERT and f"in 1 expert(s) (expert {EXPERT}: " in ex.message
    w = next(f for f in res.failures if f.check == "weights")
    assert w.tensor == W13 and w.expert == EXPERT and w.value > 1.0
    assert res.report.summary.startswith(
        f"not faithful: layer {LAYER}: tensor {W13} (shard model-00001-of-00001.safetensors): "
    )
    row = res.report.layers[LAYER]  # and the numbers: tokens routed to expert 3 see up and gate swapped
    assert row.faith_error > 0.05 and row.faith_error > 1e5 * row.faith_limit


def test_one_expert_scales_zeroed(artifact, tmp_path):
    art = tampered(artifact, tmp_path)
    rewrite_tensor(art, W13 + "_scale", zero_scales(EXPERT))  # re-sealed: checksums agree
    res = cli(art, "--max-new-tokens", 0)
    assert res.exit_code == 1
    assert f"tensor {W13}_scale in shard model-00001-of-00001.safetensors" in res.output
    assert f"scale byte 0 (2^-127) but non-zero values, first at expert {EXPERT}," in res.output


def test_shard_checksum_mismatch(artifact, tmp_path):
    art = tampered(artifact, tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    flip_byte(art, name, index=10)
    res = verify(art)
    assert not res.passed and res.report.layers == [] and res.report.exact is None  # integrity first
    (f,) = res.failures
    assert f.check == "integrity" and f.tensor == name and f.shard == "model-00001-of-00001.safetensors"


def test_wrong_swiglu_limit_in_artifact_config(artifact, tmp_path):
    art = tampered(artifact, tmp_path)
    edit_config(art, swiglu_limit=5.0)
    res = cli(art)
    assert res.exit_code == 1
    assert "config.json resolves swiglu_limit = 5.0 but porter.json resolved_config says 7.0" in res.output


def test_scale_byte_255_named(artifact, tmp_path):
    art = tampered(artifact, tmp_path)
    name = "model.layers.1.block_sparse_moe.experts.w2_weight_scale"
    rewrite_tensor(art, name, lambda s: s.index_fill(0, torch.tensor([5]), 255))
    res = verify(art)
    assert any(f.tensor == name and "255" in f.message and "expert 5" in f.message for f in res.failures)


# ---------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line


def test_input_errors_exit_2(artifact, tiny_vendor, tmp_path):
    res = cli(tmp_path / "nope")
    assert res.exit_code == 2 and "no such directory" in res.output
    res = cli(tiny_vendor)  # a checkpoint, not an artifact
    assert res.exit_code == 2 and "not a porter artifact" in res.output
    res = cli(artifact, "--reference", tmp_path / "missing")
    assert res.exit_code == 2 and "--reference not found" in res.output
    res = cli(artifact, "--reference", artifact)
    assert res.exit_code == 2 and "is a porter artifact" in res.output
    art = tampered(artifact, tmp_path)
    man = json.loads((art / "porter.json").read_text())
    man["source"]["path"] = str(tmp_path / "gone")
    (art / "porter.json").write_text(json.dumps(man))
    res = cli(art)
    assert res.exit_code == 2 and "pass --reference" in res.output
    assert cli(art, "--reference", tiny_vendor, "--max-new-tokens", 0).exit_code == 0
    if importlib.util.find_spec("matplotlib") is None:
        res = cli(artifact, "--plot", tmp_path / "p.png")
        assert res.exit_code == 2 and "PNG needs matplotlib" in res.output


def test_transformers_layout_artifact_passes(tiny_transformers, tmp_path):
    out = tmp_path / "hf"
    porter.convert(tiny_transformers, out, progress=False)
    res = verify(out, max_new_tokens=0)
    assert res.passed, res.report.summary
    assert res.report.exact.layout == "transformers" and res.report.exact.passed


# ---------------------------------------------------------------------------------------------------
# Layer streaming


def _numbers(rep):
    return rep.layers, rep.logits, rep.generation, rep.embeddings


class _CountedReads:
    """Bytes verify reads through its own shard handles (mapping._open), per folder name."""

    def __init__(self, monkeypatch):
        from porter.commands.verify import mapping

        self.bytes: dict = {}
        self.tensors: dict = {}  # (folder, tensor) -> bytes
        real = mapping._open
        count = self

        class Handle:
            def __init__(self, h, f):
                self.h, self.f = h, f

            def get_tensor(self, name):
                return count.add(self.f, name, self.h.get_tensor(name))

            def get_slice(self, name):
                handle = self

                class Slice:
                    def __getitem__(self, i):
                        return count.add(handle.f, name, handle.h.get_slice(name)[i])

                return Slice()

        monkeypatch.setattr(mapping, "_open", lambda handles, f: Handle(real(handles, f), Path(f)))
        for cls, folder in ((mapping.SourceShards, "path"), (mapping.ArtifactReader, "art")):
            monkeypatch.setattr(cls, "stage", self._staging(cls.stage, folder))

    def _staging(self, real, folder: str):
        """A staged read (runtime.staging) of these tensors, and an artifact tensor's scale with it."""
        count = self

        def stage(owner, names, device):
            staging = real(owner, names, device)
            for n, t in staging._tensors.items():  # counted as verify reads them: whole, once each
                count.add(getattr(owner, folder) / n, n, torch.empty(t.span.nbytes, dtype=torch.uint8))
            return staging

        return stage

    def add(self, f: Path, name: str, t: torch.Tensor) -> torch.Tensor:
        self.bytes[f.parent.name] = self.bytes.get(f.parent.name, 0) + t.nbytes
        self.tensors[f.parent.name, name] = self.tensors.get((f.parent.name, name), 0) + t.nbytes
        return t

    def in_numerics(self, monkeypatch) -> dict:
        """{(folder, tensor): bytes} handed out from the start of the numerics step on (filled as it runs)."""
        import porter.commands.verify as verify_mod

        real, start, count = verify_mod._numerics, {}, self

        def numerics(*a, **k):
            start.update(count.tensors)
            return real(*a, **k)

        class Since(dict):
            def __missing__(self, key):
                return count.tensors.get(key, 0) - start.get(key, 0)

            def read(self) -> dict:
                return {k: self[k] for k in count.tensors if self[k]}

        monkeypatch.setattr(verify_mod, "_numerics", numerics)
        return Since()


def _tensor_bytes(folder: Path, keep=lambda name: True) -> int:
    from porter.source.local import read_header, weight_files

    return sum(
        (i["data_offsets"][1] - i["data_offsets"][0])
        for f in weight_files(folder)
        for n, i in read_header(f).items()
        if keep(n)
    )


def test_numerics_both_reads_source_twice_and_artifact_once_per_use(artifact, tiny_vendor, monkeypatch):
    """Exact bytes reads every artifact tensor once (an expert as a slice, not its whole stacked tensor per
    expert); both numerics runs share one pass, so the bf16 and the rounded reference are read once for
    both; the rounded reference takes the MXFP8 tensors the exact step proved identical from the artifact,
    not from a second read of the source."""
    reads = _CountedReads(monkeypatch)
    res = verify(artifact, reference=tiny_vendor, numerics="both", max_new_tokens=0)
    assert res.passed
    man = json.loads((artifact / "porter.json").read_text())
    scales = {r["scale"] for r in man["tensors"].values() if r.get("scale")}
    quantized = {n for n, r in man["tensors"].items() if r.get("scale")} | scales
    art, mxfp8 = _tensor_bytes(artifact), _tensor_bytes(artifact, lambda n: n in quantized)
    src, carried = _tensor_bytes(tiny_vendor), art - mxfp8
    # artifact: exact bytes once, the rounded reference's MXFP8 tensors once for both runs
    assert reads.bytes[artifact.name] == art + mxfp8
    # source: exact bytes, the bf16 reference once, the rounded reference's carried tensors once
    assert reads.bytes[tiny_vendor.name] <= 2 * src + carried
    assert reads.bytes[tiny_vendor.name] < 3 * src  # before: 5x (exact, then both references per run)
    assert set(res.report.phases) == {"integrity", "exact", "generation", "numerics.load", "numerics.pass"}


def _sizes(folder: Path) -> dict:
    from porter.source.local import read_header, weight_files

    return {
        (folder.name, n): i["data_offsets"][1] - i["data_offsets"][0]
        for f in weight_files(folder)
        for n, i in read_header(f).items()
    }


@pytest.mark.parametrize("layout, numerics", [("porter", "w8a16"), ("porter", "both"), ("hf", "both")])
def test_streamed_verify_reads_each_layer_once_for_exact_bytes_and_the_references(
    artifact, tiny_vendor, tmp_path, monkeypatch, layout, numerics
):
    """Layer-streamed on a GPU (each layer staged onto the device: here onto the CPU), exact bytes compares
    each decoder layer inside the teacher-forced pass on the read that builds the references: verify reads
    each source and artifact tensor of the layers once (the converted model's reads are the runtime's
    own), those outside the layers twice (compared before any model is built, then read by the
    references); the figures are the resident run's."""
    from porter.commands.verify import exact

    if layout == "hf":
        artifact = tmp_path / "hf"
        porter.convert(tiny_vendor, artifact, layout="hf", progress=False)
    reads = _CountedReads(monkeypatch)
    monkeypatch.setattr(exact, "reads_ahead", lambda device: True)
    res = verify(artifact, reference=tiny_vendor, numerics=numerics, max_new_tokens=0, streaming=True)
    assert res.passed and res.report.streaming.enabled
    size = {**_sizes(tiny_vendor), **_sizes(artifact)}
    ref = ReferenceStoreOf(artifact, tiny_vendor)
    outside = {s for n in ref.names() if layer_of(n) is None for s in ref.derivation(n).sources}
    src = {k: 2 if k[1] in outside else 1 for k in _sizes(tiny_vendor)}  # the references' top tensors twice
    art = {k: 1 for k in _sizes(artifact)}
    assert reads.tensors == {k: size[k] * times for k, times in {**src, **art}.items()}
    assert "model.embed_tokens.weight" in {
        ref.derivation(n).tensor for n in ref.names() if layer_of(n) is None
    }
    resident = verify(artifact, reference=tiny_vendor, numerics=numerics, max_new_tokens=0, streaming=False)
    assert _numbers(res.report) == _numbers(resident.report)
    assert [(t.tensor, t.blocks, t.mismatched) for t in res.report.exact.tensors] == [
        (t.tensor, t.blocks, t.mismatched) for t in resident.report.exact.tensors
    ]


def test_shared_reference_tensor_kept_for_its_second_taker_only(artifact, tiny_vendor):
    """ReferenceStore.share: a shared tensor is handed out twice from one read, then read again; one left
    untaken is dropped when another layer group is asked for; a tensor not shared is read every time."""
    ref = ReferenceStoreOf(artifact, tiny_vendor)
    norm, other = "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"
    ref.share({norm})
    first = ref.get(norm)
    assert ref.value(norm) is first and ref.get(norm) is not first  # second taker, then a new read
    assert ref.get(other) is not ref.get(other)  # not shared
    kept = ref.get(norm)  # kept for a second taker that does not come before layer 2 is asked for
    ref.get("model.layers.2.input_layernorm.weight")
    assert ref.value(norm) is not kept


def ReferenceStoreOf(artifact: Path, source: Path):
    from porter.commands.verify.mapping import ArtifactReader, Mapping, ReferenceStore, SourceShards

    reader = ArtifactReader(artifact, json.loads((artifact / "porter.json").read_text()))
    return ReferenceStore(Mapping(SourceShards(source), rounding="rceil"), reader, None)


def test_rounded_reference_from_proved_artifact_bytes_is_the_rederivation(artifact, tiny_vendor):
    """What the rounded reference reads from the artifact for a proved tensor is byte for byte what it
    re-derives from the source; a tensor not proved is re-derived."""
    from porter.commands.verify.mapping import ArtifactReader, Mapping, ReferenceStore, SourceShards
    from porter.commands.verify.rounded import RoundedReferenceStore
    from porter.format.layout import scale_name

    man = json.loads((artifact / "porter.json").read_text())
    reader = ArtifactReader(artifact, man)
    stores = [
        RoundedReferenceStore(
            ReferenceStore(Mapping(SourceShards(tiny_vendor), rounding="rceil"), reader, None),
            reader,
            "rceil",
            proved=proved,
        )
        for proved in ((), reader.weights())
    ]
    rederived, from_artifact = stores
    assert not rederived.proved and set(from_artifact.proved) == rederived.quantized
    for n in sorted(rederived.quantized):
        for name in (n, scale_name(n)):
            a, b = rederived.get(name), from_artifact.get(name)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


def test_streaming_numbers_equal_full_run(artifact):
    prompts = [DEFAULT_PROMPT, "Hello world"]
    full = verify(artifact, streaming=False, max_new_tokens=2, prompts=prompts)
    stream = verify(artifact, streaming=True, max_new_tokens=2, prompts=prompts)
    assert not full.report.streaming.enabled and stream.report.streaming.enabled
    assert _numbers(stream.report) == _numbers(full.report)


def test_streaming_picked_automatically_when_it_would_not_fit(artifact, monkeypatch):
    import porter.commands.verify.generation as g

    monkeypatch.setattr(g, "memory_available", lambda device: 1 << 20)  # 1 MB free
    res = verify(artifact)
    st = res.report.streaming
    assert st.enabled and st.reason.startswith("auto")
    # the converted model does not fit either: no generation by default, and the report says how to ask
    assert res.report.max_new_tokens == 0 and res.report.generation == []
    assert st.generation.startswith("skipped: the converted model") and "--max-new-tokens N" in st.generation
    assert res.passed


MEASURE = """
import json, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
from porter.commands.verify import verify
r = verify(sys.argv[1], streaming=sys.argv[2] == "stream", max_new_tokens=1, prompts=["Hello world, hello porter."])
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
d = r.report.to_dict()
print(json.dumps({{"hwm_kb": hwm, "numbers": [d["layers"], d["logits"], d["generation"]],
                   "passed": r.passed, "streaming": d["streaming"]["enabled"]}}))
"""


def _peak(art: Path, mode: str) -> dict:
    # VmHWM of a fresh child (not ru_maxrss: that survives exec and starts from the parent's peak)
    res = subprocess.run(
        [sys.executable, "-c", MEASURE.format(root=str(ROOT)), str(art), mode],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_streaming_peak_memory_under_40_percent_of_full_load(tmp_path):
    from tiny_checkpoint import build_tiny_checkpoint, synthetic_overrides

    # 8 layers (7 MoE x 16 experts of 3 x [1024, 1024]): ~0.74 GB bf16 source, ~0.41 GB artifact
    src = build_tiny_checkpoint(tmp_path / "src", text_overrides=synthetic_overrides(8), max_shard_tensors=64)
    art = tmp_path / "art"
    porter.convert(src, art, max_shard_size="200MB", progress=False)
    full, stream = _peak(art, "full"), _peak(art, "stream")
    assert full["passed"] and stream["passed"] and stream["streaming"] and not full["streaming"]
    assert stream["numbers"] == full["numbers"]
    ratio = stream["hwm_kb"] / full["hwm_kb"]
    assert ratio < 0.40, (stream["hwm_kb"], full["hwm_kb"], ratio)


def test_a_bug_inside_a_step_is_exit_3_never_not_faithful(artifact, monkeypatch):
    import porter.commands.verify as v

    def broken(*a, **k):
        raise RuntimeError("index out of range in a kernel")

    monkeypatch.setattr(v, "compare_models", broken)
    res = CliRunner().invoke(main, ["-q", "verify", str(artifact), "--max-new-tokens", "0"])
    assert res.exit_code == 3 and "internal error: RuntimeError: index out of range" in res.output
    assert "verdict" not in res.output
