"""`porter verify` on a CUDA device: the exact re-derivation runs there and gives the CPU's answer, bit
for bit (MXFP8 is deterministic: frexp, power-of-two scaling and the round-to-nearest-even e4m3 cast)."""

from __future__ import annotations

import pytest
import torch
from verify_tamper import copy_artifact, rewrite_tensor, shift_scales

import porter
from porter.commands.verify.exact import rederive
from porter.commands.verify.mapping import ArtifactReader, Mapping, SourceShards

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def exact(art, src, device):
    import json

    man = json.loads((art / "porter.json").read_text())
    return rederive(
        ArtifactReader(art, man),
        Mapping(SourceShards(src)),
        man["options"]["scale_rounding"],
        torch.device(device),
    )


@pytest.mark.parametrize("tamper", [False, True])
def test_exact_on_cuda_equals_cpu(tiny_vendor, tmp_path, tamper):
    art = tmp_path / "art"
    porter.convert(tiny_vendor, art, progress=False)
    if tamper:
        art = copy_artifact(art, tmp_path / "t")
        w13 = "model.layers.2.block_sparse_moe.experts.w13_weight"
        rewrite_tensor(art, w13 + "_scale", shift_scales(+1, expert=3))
    cpu, gpu = exact(art, tiny_vendor, "cpu"), exact(art, tiny_vendor, "cuda")
    assert gpu.device.startswith("cuda") and cpu.passed == gpu.passed == (not tamper)
    for a, b in zip(cpu.tensors, gpu.tensors):
        assert (
            a.tensor,
            a.blocks,
            a.mismatched,
            a.scale_mismatched,
            a.mismatched_by_expert,
            a.first_mismatch,
        ) == (b.tensor, b.blocks, b.mismatched, b.scale_mismatched, b.mismatched_by_expert, b.first_mismatch)
        assert b.weight_error == pytest.approx(a.weight_error, rel=1e-6, abs=1e-12)
    if tamper:
        (bad,) = [t for t in gpu.tensors if not t.exact]
        assert bad.mismatched_by_expert == {3: 128 * 2}  # every block of expert 3: [128, 64] -> 128 x 2


def test_verify_cli_on_cuda(tiny_vendor, tmp_path):
    from click.testing import CliRunner

    from porter.cli import main

    art = tmp_path / "art"
    porter.convert(tiny_vendor, art, progress=False)
    res = CliRunner().invoke(
        main,
        [
            "verify",
            str(art),
            "--device",
            "cuda",
            "--max-new-tokens",
            "4",
            "--backend",
            "torch",
            "--dtype",
            "float32",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "exact bytes (vendor layout, rceil scales, cuda" in res.output and "verdict: PASS" in res.output


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs")
def test_generation_spreads_over_the_visible_gpus(tiny_vendor, tmp_path):
    from porter.commands.verify import verify

    art = tmp_path / "art"
    porter.convert(tiny_vendor, art, progress=False)
    rep = verify(
        art,
        device="cuda",
        backend="torch",
        dtype=torch.float32,
        max_new_tokens=3,
        prompts=["Hello world", "The quick brown fox jumps over the lazy dog."],
    ).report
    assert rep.passed, rep.summary
    assert (
        rep.streaming.generation
        == "resident over the visible GPUs (device_map auto), one padded batch of 2 prompts"
    )
    assert [len(g.converted_tokens) for g in rep.generation] == [3, 3]


@pytest.mark.parametrize("tamper", [None, "byte", "scale"])
def test_streamed_verify_on_cuda_checks_each_layer_in_the_pass(tiny_vendor, tmp_path, tamper):
    """Layer-streamed on the GPU, exact bytes compares each layer on the references' staged read of it:
    the same exact results and figures as a resident verify on the GPU; a changed byte fails integrity
    with the numerics withheld, a planted scale shift fails exact bytes and the numerics still run."""
    from verify_tamper import flip_byte

    from porter.commands.verify import exact as exact_mod

    art = tmp_path / "art"
    porter.convert(tiny_vendor, art, progress=False)
    w13 = "model.layers.2.block_sparse_moe.experts.w13_weight"
    if tamper:
        art = copy_artifact(art, tmp_path / "t")
        if tamper == "byte":
            flip_byte(art, w13, index=70 * 256 + 3)
        else:
            rewrite_tensor(art, w13 + "_scale", shift_scales(+1, expert=3))
    compared = []
    real = exact_mod.ExactBytes.run_layer
    exact_mod.ExactBytes.run_layer = lambda self, i: compared.append(i) or real(self, i)
    try:
        kw = dict(reference=tiny_vendor, device="cuda", max_new_tokens=0, numerics="both")
        stream = porter.verify(art, streaming=True, **kw).report
    finally:
        exact_mod.ExactBytes.run_layer = real
    if tamper == "byte":  # the numerics withheld: no streaming record either
        assert not stream.integrity.passed and stream.exact is None and stream.layers == []
        assert stream.streaming is None and compared == [0, 1, 2]
        return
    resident = porter.verify(art, streaming=False, **kw).report
    assert stream.streaming.enabled and not resident.streaming.enabled
    assert compared == list(range(len(resident.layers)))
    assert stream.passed == resident.passed == (tamper is None)
    for a, b in zip(resident.exact.tensors, stream.exact.tensors):
        assert (a.tensor, a.blocks, a.mismatched, a.mismatched_by_expert) == (
            b.tensor,
            b.blocks,
            b.mismatched,
            b.mismatched_by_expert,
        )
    figures = lambda r: [(x.cosine, x.rel_error, x.layer_error, x.faith_error) for x in r.layers]
    assert len(stream.layers) == len(resident.layers) > 0
    for a, b in zip(figures(resident), figures(stream)):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7)
