"""vLLM 0.33.0 and sglang 0.5.23 load porter's `--layout hf` output through their own code (CPU).

Run by tests/engines/run.sh (its own venv with both engines). One subprocess per engine (each sets
process-wide distributed and platform state): tests/engines/vllm_harness.py and sglang_harness.py build the
engine's MiniMax-M3 model from porter's config.json with the real MXFP8 quantization config, fill every
parameter with a sentinel, feed the artifact through the engine's own load_weights and report; this file
asserts on the reports.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_checkpoint import build_tiny_checkpoint

import converters
import converters.minimax_m3 as m3
from porter.cli import main as cli
from porter.source import open_local

arch = converters.get("minimax_m3_vl")  # the MiniMax-M3 converter

HERE = Path(__file__).resolve().parent
ENGINES = {"vllm": ("vllm_harness.py", "0.33.0", 29555), "sglang": ("sglang_harness.py", "0.5.23", 29633)}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """porter's tiny `--layout hf` output (default scope: all), made through the CLI; and the ignore list
    porter writes when nothing is quantized (every text linear listed)."""
    d = tmp_path_factory.mktemp("engines")
    src = build_tiny_checkpoint(d / "src", layout="vendor", seed=3)
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(d / "hf"), "--layout", "hf", "-q"])
    assert res.exit_code == 0, res.output
    source = open_local(src)
    plan = arch.plan_tensors(arch.resolve_config(source.raw_config), source.meta, "none", layout="hf")
    (d / "all_listed.json").write_text(json.dumps(m3.hf_layout.hf_ignored_layers(plan)))
    return d


def run_engine(name: str, script: str, *args) -> None:
    """Runs one harness of engine `name` (vllm, sglang) in its own process; fails with its output if it fails."""
    _, version, port = ENGINES[name]
    assert importlib.util.find_spec(name) is not None, f"{name} is not installed; run tests/engines/run.sh"
    from importlib.metadata import version as installed

    assert installed(name) == version, f"{name} {installed(name)} installed, the suite pins {version}"
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PORTER_ENGINE_PORT": str(port)},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def run_harness(name: str, art: Path, out: Path, all_listed: Path) -> dict:
    run_engine(name, ENGINES[name][0], art, out, all_listed)
    rep = json.loads(out.read_text())
    rep["config"] = json.loads((art / "config.json").read_text())
    return rep


@pytest.fixture(scope="module", params=list(ENGINES))
def report(request, artifact):
    return run_harness(
        request.param, artifact / "hf", artifact / f"{request.param}.json", artifact / "all_listed.json"
    )


def test_every_parameter_written_no_sentinel_left(report):
    assert report["fed_tensors"] > 200  # the tiny artifact's text tensors, all fed
    assert report["sentinel_left"] == {}, f"{report['engine']}: parameters not (fully) written"
    assert all(
        n.endswith(("attn.k_scale", "attn.v_scale", "attn.q_scale", "attn.prob_scale"))
        for n in report["kv_scale_params"]
    )
    if report["engine"] == "vllm":  # vLLM's load_weights returns the names it wrote
        assert report["not_loaded"] == []
        assert report["loaded"] == report["params"] - len(report["kv_scale_params"])
    else:  # sglang's VL load_weights returns nothing: written == no sentinel left
        assert report["written"] == report["params"] - len(report["kv_scale_params"])


def test_fused_qkv_index_and_expert_rows_byte_equal(report):
    # at least: 3 MoE layers x 8 experts x (w13, w2) x (weight, scale); plus q|k|v(|index) rows per layer
    assert report["rows_checked"] >= 3 * 8 * 2 * 2 + 4 * 2 * 3
    assert report["rows_mismatched"] == []


def test_engine_ignore_matching_agrees_with_porter_module_by_module(report):
    listed = set(report["config"]["quantization_config"]["ignored_layers"])
    assert "language_model.lm_head" in listed
    modules = report["ignore"]
    assert len(modules) >= 4 * 4 + 1
    for m in modules:
        assert len(set(m["porter_listed"])) == 1, f"{m['module']}: porter lists only part of a fused module"
        assert m["engine_excluded"] == m["porter_listed"][0], m
        # with porter's list for an all-bf16 artifact, the engine skips every module too (names match)
        assert m["engine_excluded_all_listed"], m
        # and what the engine built agrees: MXFP8 params exactly where porter quantized
        if m["engine_dtype"] is not None:
            assert (m["engine_dtype"] == "torch.float8_e4m3fn") == (not m["porter_listed"][0]), m


@pytest.mark.parametrize("engine", list(ENGINES))
def test_stacked_experts_are_caught(engine, artifact, tmp_path):
    """Negative control: layer 1's experts stacked porter-style (`experts.w13_weight`, `w13_weight_scale`)
    instead of per expert. The engines load that without an error; the suite must still fail it."""
    src = artifact / "hf"
    tensors = {}
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors |= {k: h.get_tensor(k) for k in h.keys()}
    m = "language_model.model.layers.1.block_sparse_moe.experts."
    per_expert = [k for k in tensors if k.startswith(m)]
    for suffix, scale in ((".weight", ""), (".weight_scale_inv", "_scale")):
        tensors[m + "w13_weight" + scale] = torch.stack(
            [torch.cat([tensors[m + f"{e}.w1{suffix}"], tensors[m + f"{e}.w3{suffix}"]]) for e in range(8)]
        )
        tensors[m + "w2_weight" + scale] = torch.stack([tensors[m + f"{e}.w2{suffix}"] for e in range(8)])
    for k in per_expert:
        del tensors[k]
    bad = tmp_path / "stacked"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    (bad / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model.safetensors" for k in tensors}})
    )
    (bad / "config.json").write_text((src / "config.json").read_text())
    rep = run_harness(engine, bad, tmp_path / "report.json", artifact / "all_listed.json")
    left = [n for n in rep["sentinel_left"] if "layers.1." in n and "experts" in n]
    assert left, f"{engine}: stacked experts went unnoticed"
    assert not [n for n in rep["sentinel_left"] if "layers.1." not in n]  # only the tampered layer
