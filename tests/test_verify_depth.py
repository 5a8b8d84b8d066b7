"""`porter verify` at depth: the verdict is faithfulness — the converted model against the source rounded by
verify's own MXFP8 re-derivation, each layer alone on the same input, within what float rounding explains
(porter/commands/verify/faithfulness.py) — and the MXFP8 cost against the bf16 source is reported apart as
quality. Synthetic models of 2, 8, 16 and 60 layers at tiny width, and MiniMax-M3's real layer dims:

- a faithful conversion passes at every depth (exit 0), in float32 (both models compute the same thing: 0
  exactly) and in bfloat16 with the converted model's MoE computed in another rounding order (fp32 inside,
  as porter's Triton kernel does: tests/verify_tamper.py Fp32InsideMoE): the gap stays under half its limit;
- every planted bug fails (exit 1) naming its layer, far past the limit: bytes (one expert's gate and up
  swapped; one expert's w2 scales + 1, re-sealed so integrity passes) and what a runtime or kernel bug does
  with right bytes (SwiGLU alpha 1.0; routed_scaling_factor 1.0) — at the deepest layers of every model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny_checkpoint import build_tiny_checkpoint, real_dims_overrides, synthetic_overrides
from verify_tamper import (
    copy_artifact,
    fp32_inside,
    patch_converted,
    rewrite_tensor,
    runtime_bug,
    shift_scales,
    swap_gate_up,
)

import porter
from porter.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

DEPTHS = (2, 8, 16, 60)
PROMPT = "The quick brown fox jumps over the lazy dog. Each token is routed to a few experts."
BUGS = ("gate_up", "scale", "alpha", "rsf")  # bytes, bytes, runtime, runtime
BYTES = {"gate_up": "w13_weight", "scale": "w2_weight_scale"}
EXPERT = 1
# Asserted margins. float32: both models hold the same bytes and run the same ops, so a faithful layer is 0
# and a planted bug is >= 0.1 of its update against a limit of ~3e-7. bfloat16 with another rounding order:
# the gap measured 0.21-0.28 of the limit (2 to 60 layers, real dims), the weakest bug (alpha) 3.3x.
FAITHFUL_BF16 = 0.5
CAUGHT = {"float32": 1e4, "bfloat16": 2.0}


def build(root: Path, layers: int, overrides: dict) -> Path:
    src = build_tiny_checkpoint(root / "src", text_overrides=overrides, max_shard_tensors=400)
    porter.convert(src, root / "art", progress=False)
    return root / "art"


@pytest.fixture(scope="module", params=DEPTHS, ids=[f"{n}-layers" for n in DEPTHS])
def model(request, tmp_path_factory) -> tuple[int, Path]:
    n = request.param
    root = tmp_path_factory.mktemp(f"depth{n}")
    return n, build(root, n, synthetic_overrides(n, hidden=64, intermediate=64, experts=4))


def cli(art: Path, report: Path, *args):
    res = CliRunner().invoke(
        main,
        [
            "-q",
            "verify",
            str(art),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "0",
            "--report",
            str(report),
            *args,
        ],
    )
    if res.exception and not isinstance(res.exception, SystemExit):
        raise res.exception
    return res, json.loads(report.read_text())


def ratios(rep: dict) -> dict:
    """{layer: faith_error / faith_limit}."""
    return {r["layer"]: r["faith_error"] / r["faith_limit"] for r in rep["layers"]}


def plant(art: Path, tmp_path: Path, monkeypatch, bugs: dict, *hooks) -> Path:
    """A copy of `art` with the byte bugs of `bugs` ({layer: kind}) written (re-sealed), the runtime bugs
    hooked into the converted model as verify loads it, after `hooks`."""
    out = copy_artifact(art, tmp_path / "planted")
    runtime_hooks = list(hooks)
    for layer, kind in bugs.items():
        name = f"model.layers.{layer}.block_sparse_moe.experts.{BYTES.get(kind, '')}"
        if kind == "gate_up":
            rewrite_tensor(out, name, swap_gate_up(EXPERT))
            rewrite_tensor(out, name + "_scale", swap_gate_up(EXPERT))
        elif kind == "scale":
            rewrite_tensor(out, name, shift_scales(+1, EXPERT))
        else:
            runtime_hooks.append(runtime_bug(kind, layer, EXPERT))
    patch_converted(monkeypatch, out, *runtime_hooks)
    return out


def placements(n: int) -> list[dict]:
    """Where the bugs go: the deepest MoE layers, one bug each; a 2-layer model has one, so one run each."""
    if n - 1 >= len(BUGS):
        return [{n - 1 - k: kind for k, kind in enumerate(BUGS)}]
    return [{n - 1: kind} for kind in BUGS]


def assert_caught(res, rep: dict, bugs: dict, dtype: str) -> None:
    assert res.exit_code == 1, res.output
    assert rep["verdict"] == "fail" and rep["summary"].startswith("not faithful: ")
    r = ratios(rep)
    faith = {f["layer"] for f in rep["failures"] if f["check"] == "faithfulness"}
    assert faith == set(bugs), (faith, bugs)  # each planted layer, and no other, fails faithfulness
    for layer in bugs:
        assert r[layer] >= CAUGHT[dtype], (layer, bugs[layer], r[layer])
    clean = [r[i] for i in r if i not in bugs]
    assert all(x <= (0.0 if dtype == "float32" else FAITHFUL_BF16) for x in clean), clean
    for layer, kind in bugs.items():
        if kind in BYTES:  # the bytes are named too
            assert any(f["check"] == "exact" and f["layer"] == layer for f in rep["failures"]), kind


# ---------------------------------------------------------------------------------------------------
# 2, 8, 16 and 60 layers


def test_faithful_conversion_passes_at_every_depth(model, tmp_path):
    n, art = model
    res, rep = cli(art, tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    verdict = res.output.strip().splitlines()[-1]
    assert verdict.startswith(
        "verdict: PASS — faithful: bytes identical to verify's re-derivation; every layer, the embeddings "
        "and the logits within float rounding of the rounded source (worst 0 of its limit); quality reported, "
        "not judged"
    ), verdict
    assert len(rep["layers"]) == n and all(r["faith_error"] == 0.0 for r in rep["layers"])
    assert all(0 < r["faith_limit"] < 1e-6 for r in rep["layers"])  # float32: K u sqrt(...) with u = 2^-24
    fs = rep["faithfulness"]
    assert (fs["precision"], fs["unit_roundoff"], fs["embeddings_error"], fs["logits_error"]) == (
        "float32",
        2**-24,
        0.0,
        0.0,
    )
    # quality is measured and reported, not judged: the MXFP8 cost grows with depth on a random model
    assert rep["logits"]["kl"] > 0 and not rep["figures"]["logits.kl"]["decides"]
    assert (
        rep["figures"]["logits.kl"]["kind"] == "quality" and rep["figures"]["layers[].faith_error"]["decides"]
    )


def test_bf16_rounding_order_stays_under_the_limit(model, tmp_path, monkeypatch):
    """The converted model's MoE in another rounding order (fp32 inside), both models in bfloat16: what a GPU
    kernel against the torch reference does. Nonzero, and under half the limit at every depth."""
    n, art = model
    patch_converted(monkeypatch, art, fp32_inside)
    res, rep = cli(art, tmp_path / "r.json", "--dtype", "bfloat16")
    assert res.exit_code == 0, res.output
    r = ratios(rep)
    moe = [i for i in r if i > 0]  # layer 0 is dense: the same ops in both models
    assert r[0] == 0.0 and all(0 < r[i] < FAITHFUL_BF16 for i in moe), r
    assert rep["faithfulness"]["precision"] == "bfloat16" and rep["faithfulness"]["unit_roundoff"] == 2**-8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planted_bugs_fail_at_every_depth(model, tmp_path, monkeypatch, dtype):
    n, art = model
    for k, bugs in enumerate(placements(n)):
        with monkeypatch.context() as mp:
            hooks = [fp32_inside] if dtype == "bfloat16" else []
            planted = plant(art, tmp_path / str(k), mp, bugs, *hooks)
            res, rep = cli(planted, tmp_path / f"r{k}.json", "--dtype", dtype)
        assert_caught(res, rep, bugs, dtype)
    assert "verdict: FAIL — not faithful: " in res.output


# ---------------------------------------------------------------------------------------------------
# MiniMax-M3's real layer dims


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Iterator[Path]:
    """Hidden 6144, expert width 3072, 64 query / 4 key-value heads of 128 (docs/minimax-m3.md): two MoE layers
    of 2 experts (layer 0 full attention, layer 1 sparse; no dense layer, whose MLP is not the point here)."""
    overrides = real_dims_overrides(2, experts=2) | {"moe_layer_freq": [1, 1]}
    root = tmp_path_factory.mktemp("real")
    yield build(root, 2, overrides)
    shutil.rmtree(root)  # 2 GB of disk


@pytest.mark.slow
def test_real_dims_faithful_passes_and_bugs_fail(real, tmp_path, monkeypatch):
    """bfloat16, the converted model's MoE in another rounding order (as above): a faithful conversion passes
    under half the limit; each bug, one per layer, fails its layer."""
    with monkeypatch.context() as mp:
        patch_converted(mp, real, fp32_inside)
        res, rep = cli(real, tmp_path / "bf16.json", "--dtype", "bfloat16")
    r = ratios(rep)
    assert res.exit_code == 0 and all(0 < r[i] < FAITHFUL_BF16 for i in (0, 1)), (r, res.output)
    for k, bugs in enumerate(({0: "gate_up", 1: "alpha"}, {0: "scale", 1: "rsf"})):
        with monkeypatch.context() as mp:
            planted = plant(real, tmp_path / str(k), mp, bugs, fp32_inside)
            res, rep = cli(planted, tmp_path / f"r{k}.json", "--dtype", "bfloat16")
        shutil.rmtree(planted)  # 0.9 GB of disk
        assert_caught(res, rep, bugs, "bfloat16")


# ---------------------------------------------------------------------------------------------------
# The table of docs/verify.md ("Faithfulness: the limit"): python tests/test_verify_depth.py [--real]


def margins(art: Path, root: Path, last: int) -> dict:
    """faith_error / faith_limit: the worst layer of a faithful run, and the planted layer of each bug alone
    (in `last`), in float32 and in bfloat16 with the other rounding order."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        hooks = [fp32_inside] if dtype == "bfloat16" else []
        for bug in (None, *BUGS):
            mp = pytest.MonkeyPatch()
            work = root / f"{dtype}-{bug}"
            work.mkdir(parents=True, exist_ok=True)
            planted = plant(art, work, mp, {last: bug} if bug else {}, *hooks)
            try:
                _, rep = cli(planted, work / "r.json", "--dtype", dtype)
            finally:
                mp.undo()
            r = ratios(rep)
            out[(dtype, bug)] = r[last] if bug else max(r.values())
    return out


if __name__ == "__main__":
    import sys
    import tempfile

    import torch

    torch.set_num_threads(1)
    real_dims = "--real" in sys.argv
    models = (
        [("real dims (2 MoE layers)", real_dims_overrides(2, experts=2) | {"moe_layer_freq": [1, 1]}, 2)]
        if real_dims
        else [(str(n), synthetic_overrides(n, hidden=64, intermediate=64, experts=4), n) for n in DEPTHS]
    )
    print(
        "| layers | faithful, float32 | faithful, bfloat16, other rounding order | " + " | ".join(BUGS) + " |"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides, n in models:
            root = Path(tmp) / name.split()[0]
            m = margins(build(root, n, overrides), root, n - 1)
            bugs = " | ".join(f"{m[('float32', b)]:.2g} / {m[('bfloat16', b)]:.3g}" for b in BUGS)
            print(
                f"| {name} | {m[('float32', None)]:.2g} | {m[('bfloat16', None)]:.3g} | {bugs} |", flush=True
            )
