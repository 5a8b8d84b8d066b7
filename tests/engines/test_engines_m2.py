"""MiniMax-M2: what sglang 0.5.23 and vLLM 0.33.0 do with porter's `--layout hf` output (CPU).

The tiny M2 release-format source (examples/minimax_m2_tiny_checkpoint.py, block-FP8) is converted through the
CLI with `--layout hf`; tests/engines/sglang_m2_harness.py and vllm_m2_harness.py build each engine's own
`MiniMaxM2ForCausalLM` from that config.json, fill every parameter with a sentinel, run its `load_weights`
over porter's tensors and compare every parameter with porter's bytes (docs/serving-engines.md#minimax-m2).

sglang loads porter's output. vLLM 0.33.0 refuses porter's scale name `weight_scale_inv` for M2 (its M2
mapper lacks the rename its M3 loader has): that is asserted as the documented incompatibility, and the load
is proven complete once that one rename is added to vLLM's mapper.
"""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from minimax_m2_tiny_checkpoint import build_m2_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file
from test_engines import run_engine

from porter.cli import main as cli

LAYERS, EXPERTS = 3, 8
KV_SCALES = ("attn.k_scale", "attn.v_scale", "attn.q_scale", "attn.prob_scale")


@pytest.fixture(scope="module")
def m2(tmp_path_factory):
    """porter's tiny M2 `--layout hf` output (default scope: all), made through the CLI."""
    d = tmp_path_factory.mktemp("engines-m2")
    src = build_m2_checkpoint(d / "src", layout="fp8", seed=3)
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(d / "hf"), "--layout", "hf", "-q"])
    assert res.exit_code == 0, res.output
    return d


def harness(engine: str, art: Path, out: Path, *flags) -> dict:
    run_engine(engine, f"{engine}_m2_harness.py", art, out, *flags)
    return json.loads(out.read_text())


def rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of artifact `src` whose tensors (name -> tensor) went through `edit`."""
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            tensors |= {k: h.get_tensor(k) for k in h.keys()}
    tensors = edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model.safetensors" for k in tensors}})
    )
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture(scope="module")
def vllm_spelling(m2):
    """porter's artifact with every `X.weight_scale_inv` renamed `X.weight_scale` (vLLM's parameter name)."""
    return rewrite(
        m2 / "hf",
        m2 / "weight_scale",
        lambda t: {k.removesuffix("_inv") if k.endswith(".weight_scale_inv") else k: v for k, v in t.items()},
    )


@pytest.fixture(scope="module", params=["sglang", "vllm-with-scale-rename"])
def loaded(request, m2):
    """The engines' reports where the load goes through: sglang as it is, vLLM with the one rename added to
    `MiniMaxM2Model.hf_to_vllm_mapper` that its M3 loader does."""
    engine = request.param.split("-")[0]
    flags = ["--rename-scales"] if engine == "vllm" else []
    return harness(engine, m2 / "hf", m2 / f"{request.param}.json", *flags)


def test_m2_every_parameter_written_byte_equal_mtp_skipped(loaded):
    kv = loaded["kv_scale_params"]
    assert kv and all(n.endswith(KV_SCALES) for n in kv)  # defaults by design, no checkpoint tensor
    assert loaded["error"] is None
    # the engine's registry entry for porter's `quant_method: "mxfp8"`
    assert loaded["quant_config"] == {"sglang": "Fp8Config", "vllm": "ModelOptMxFp8Config"}[loaded["engine"]]
    assert loaded["sentinel_left"] == {}, f"{loaded['engine']}: parameters not (fully) written"
    # per layer 14: qkv, o, w13, w2 (weight + scale each), q/k norms, 2 layernorms, router gate and bias;
    # embeddings, final norm, lm_head
    assert len(loaded["written"]) == loaded["params"] - len(kv) == LAYERS * 14 + 3
    assert loaded["not_loaded"] == [] and sorted(loaded["loaded"]) == loaded["written"]
    # each parameter equals porter's bytes in the engine's fused order ([q; k; v], [w1_e; w3_e], w2_e)
    assert sorted(loaded["checked"]) == loaded["written"]
    assert loaded["mismatched"] == []
    # every tensor porter wrote went into a parameter, except the MTP layer the engines skip
    assert len(loaded["fed"]) == 192
    assert loaded["mtp"] == [f"model.layers.{LAYERS}.{n}.weight" for n in ("eh_proj", "enorm", "hnorm")]
    assert loaded["unused"] == loaded["mtp"]
    assert not [n for n in loaded["written"] if n.startswith(f"model.layers.{LAYERS}.")]


def test_m2_fp8_parameters_exactly_where_porter_quantized(loaded):
    modules = loaded["module_dtypes"]
    assert len(modules) == LAYERS * 4 + 1  # qkv, o, experts, router gate per layer; lm_head
    for m in modules:
        assert len(set(m["porter_listed"])) == 1, f"{m['module']}: porter lists only part of a fused module"
        assert (m["engine_dtype"] == str(torch.float8_e4m3fn)) == (not m["porter_listed"][0]), m
    assert {m["module"].rsplit(".", 1)[-1] for m in modules if m["porter_listed"][0]} == {"gate", "lm_head"}


def test_vllm_m2_refuses_porter_scale_names(m2, tmp_path):
    """vLLM 0.33.0's M2 loader has no parameter for any `weight_scale_inv` name porter writes: the load stops
    at the first one in the artifact's order (an expert scale); each fed alone raises; everything else loads
    and leaves exactly the MXFP8 scale parameters unwritten."""
    rep = harness("vllm", m2 / "hf", tmp_path / "vllm.json")
    first = next(n for n in rep["fed"] if n.endswith(".weight_scale_inv"))
    assert first == "model.layers.0.block_sparse_moe.experts.0.w1.weight_scale_inv"
    assert rep["error"] == {
        "type": "AttributeError",
        "message": "Layer model.layers.0.mlp.experts has no parameter 'w13_weight_scale_inv' for checkpoint "
        "weight 'model.layers.0.mlp.experts.0.w1.weight_scale_inv'",
    }
    each = rep["each_scale"]
    assert len(each) == LAYERS * (4 + 3 * EXPERTS)  # q, k, v, o and w1, w2, w3 per expert
    for name, err in each.items():
        layer = name.split(".")[2]
        if ".experts." in name:
            w = "w2" if ".w2." in name else "w13"
            assert err["type"] == "AttributeError", name
            assert err["message"].startswith(
                f"Layer model.layers.{layer}.mlp.experts has no parameter '{w}_weight_scale_inv'"
            ), err
        elif ".o_proj." in name:
            assert err["type"] == "ValueError", name
            assert err["message"].startswith(
                f"There is no module or parameter named 'layers.{layer}.self_attn.o_proj.weight_scale_inv'"
            ), err
        else:  # q/k/v: the stacked mapping sends `qkv_proj.weight_scale_inv` into the module itself
            assert err == {
                "type": "AttributeError",
                "message": "'QKVParallelLinear' object has no attribute 'data'",
            }
    assert rep["without_scales"]["error"] is None
    scales = rep["without_scales"]["sentinel_left"]
    assert len(scales) == LAYERS * 4 and all(n.endswith("weight_scale") for n in scales)


def test_vllm_m2_loads_the_weight_scale_spelling(m2, vllm_spelling, tmp_path):
    """The other spelling loads in vLLM as it is, byte-equal to porter's: the scale name is the only
    difference."""
    rep = harness("vllm", vllm_spelling, tmp_path / "vllm.json", "--reference", m2 / "hf")
    assert rep["error"] is None and rep["sentinel_left"] == {} and rep["not_loaded"] == []
    assert len(rep["checked"]) == LAYERS * 14 + 3 and rep["mismatched"] == []


def test_sglang_m2_skips_the_weight_scale_spelling_silently(m2, vllm_spelling, tmp_path):
    """...and sglang skips it without an error, leaving every MXFP8 scale unloaded: one artifact cannot serve
    both engines. The sentinel is what shows it."""
    rep = harness("sglang", vllm_spelling, tmp_path / "sglang.json", "--reference", m2 / "hf")
    assert rep["error"] is None
    left = sorted(rep["sentinel_left"])
    assert len(left) == LAYERS * 4 and all(n.endswith("weight_scale_inv") for n in left), left
    assert sorted(rep["mismatched"]) == left  # everything else byte-equal


def test_sglang_m2_swapped_gate_and_up_are_caught(m2, tmp_path):
    """Negative control for the byte comparison: layer 1 expert 0's w1 (gate) and w3 (up) weights swapped
    load without an error and fill every parameter; only the comparison with porter's bytes fails it."""
    m = "model.layers.1.block_sparse_moe.experts.0."

    def swap(t):
        t[m + "w1.weight"], t[m + "w3.weight"] = t[m + "w3.weight"], t[m + "w1.weight"]
        return t

    tampered = rewrite(m2 / "hf", tmp_path / "swapped", swap)
    rep = harness("sglang", tampered, tmp_path / "sglang.json", "--reference", m2 / "hf")
    assert rep["error"] is None and rep["sentinel_left"] == {}
    assert rep["mismatched"] == ["model.layers.1.block_sparse_moe.experts.w13_weight"]
