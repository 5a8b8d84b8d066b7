"""benchmarks/decode.py's floor arithmetic on a tiny MiniMax-M2 loaded on the CPU (the GPU timings themselves
run on a GPU only): the bytes a decode step reads (attention and norm weights, the touched experts with their
scales, the fp32 router, the KV cache), the experts a batch touches, and the projection to the real model's
62 MoE layers; and the script's CPU smoke run of the whole M2 path (build, convert, load, layer steps,
generate) writing its table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import m2_fixtures as fx
import pytest
import torch

import porter
import runtime

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "decode.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load_script()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("m2-bench")
    art = tmp / "art"
    porter.convert(fx.checkpoint(tmp, "fp8"), art, progress=False)  # --quantize experts
    return runtime.load(art, device="cpu")


def test_m2_step_bytes_are_the_weights_and_cache_it_reads(bench, model):
    cfg, layer = model.cfg, model.layers[0]
    H, I, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts  # 256, 128, 8
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim  # 256, 128
    # bf16 q/k/v/o (experts-only scope), q/k norms over all heads, the two layer norms
    attention = 2 * (q * H + 2 * kv * H + H * q) + 2 * (q + kv + 2 * H)
    assert bench.attention_bytes(layer) == attention == 395008
    # per expert: e4m3 w13 [2I, H] + w2 [H, I], one uint8 scale per 32 along K; router fp32 [E, H] + bias [E]
    expert = 2 * I * H + H * I + (2 * I * H + H * I) // 32
    assert bench.mlp_bytes(layer, 3) == 3 * expert + 4 * E * H + 4 * E == 3 * 101376 + 8224
    assert bench.cache_bytes(cfg, layer, batch=2, kv=64) == 2 * 64 * kv * 2 * 2 == 65536


def test_m2_touched_experts_and_projection(bench, model):
    layer, fam = model.layers[0], bench.FAMILIES["minimax_m2"]
    h = torch.randn(1, 1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert bench.is_moe(layer)
    assert bench.experts_touched(layer, h) == model.cfg.num_experts_per_tok == 3
    many = torch.randn(32, 1, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert bench.experts_touched(layer, many) == model.cfg.num_local_experts == 8
    rows = [{"kind": "moe", "ms": 0.2, "floor_ms": 0.1}, {"kind": "moe", "ms": 0.4, "floor_ms": 0.1}]
    p = bench.project(fam, rows, head_ms=0.5)
    assert p["step_ms"] == pytest.approx(62 * 0.3 + 0.5)
    assert p["floor_layers_ms"] == pytest.approx(6.2)
    assert bench.FAMILIES["minimax_m3"].projected == "3 dense + 57 MoE" and fam.projected == "62 MoE"


@pytest.mark.slow
def test_m2_cpu_smoke_run_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--family", "minimax_m2", "--device", "cpu", "--tiny"]
    cmd += ["--layers", "2", "--experts", "8", "--scopes", "experts", "--cases", "1x16"]
    cmd += ["--prefill-tokens", "8", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT, timeout=600)
    md = (out / "decode_minimax_m2_cpu.md").read_text()
    assert "| 1 | 16 | 1 | moe |" in md  # layer 1's row of the batch-1 case
    assert "projected step ms (62 MoE + lm_head)" in md
    assert "the real 256-expert model touches more" in md
