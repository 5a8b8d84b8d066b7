"""End to end on a CUDA GPU (run on the H200; skipped on CPU CI): backend auto-selection, the runtime on
CUDA against CPU, and `porter verify --backend triton --device cuda` on the embedded example."""

import json

import pytest
import torch
from click.testing import CliRunner

import porter
import runtime
from porter.cli import main as cli
from runtime.moe import resolve_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "tiny-mxfp8"
    porter.convert(tiny_vendor, out, progress=False)
    return out


def test_auto_picks_triton_on_sm90():
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        pytest.skip(f"SM{cap[0]}{cap[1]} is not Hopper")
    assert resolve_backend("auto", torch.device("cuda")) == "triton"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_logits_match_cpu(artifact, backend):
    ids = torch.randint(0, 384, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = runtime.load(artifact, device="cpu")(ids)
    out = runtime.load(artifact, device="cuda", dtype=torch.float32, backend=backend)(ids.cuda()).cpu()
    rel = float((out - ref).norm() / ref.norm())
    # torch: same math on another device (1e-5); triton: fp16 dequant + bf16 activations in the MoE (1e-2)
    assert rel <= (1e-5 if backend == "torch" else 1e-2), rel


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_verify_triton_on_cuda_passes(artifact, tmp_path, dtype):
    report = tmp_path / "r.json"
    res = CliRunner().invoke(
        cli,
        [
            "verify",
            str(artifact),
            "--backend",
            "triton",
            "--device",
            "cuda",
            "--dtype",
            dtype,
            "--report",
            str(report),
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(report.read_text())
    assert doc["verdict"] == "pass" and doc["passed"] is True
