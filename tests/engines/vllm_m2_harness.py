"""vLLM 0.33.0: feed porter's MiniMax-M2 `--layout hf` artifact to vLLM's own `MiniMaxM2ForCausalLM` on CPU.

    python tests/engines/vllm_m2_harness.py ARTIFACT_DIR REPORT.json [--reference DIR] [--rename-scales]

The config comes from vLLM's own `get_config` over the artifact folder, the quantization config from vLLM's
registry for porter's `quant_method` ("mxfp8" -> `ModelOptMxFp8Config`) with the class's packed modules, and
every tensor goes through `MiniMaxM2ForCausalLM.load_weights` as vLLM's DefaultModelLoader hands them on.
Patched as in vllm_harness.py (GPU kernel choice only): `select_linear_kernel`, `ModelOptMxFp8FusedMoE.__init__`.

vLLM's M2 mapper has no `weight_scale_inv` -> `weight_scale` rename (its M3 loader has one), so porter's
scale names raise; the report records that error and what was written before it. `--rename-scales` adds that
one rename to `MiniMaxM2Model.hf_to_vllm_mapper` (what vLLM would need, docs/serving-engines.md#minimax-m2)
and the load is then checked like the M3 one: every parameter written, fused rows byte-equal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_common as common  # noqa: E402  (imports transformers first)

common.stub_torchvision()

import m2_common  # noqa: E402
import vllm_harness as m3h  # noqa: E402  (the GPU-only pieces it patches, shared with the M3 harness)
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402
from vllm.model_executor.model_loader.utils import configure_quant_config  # noqa: E402
from vllm.model_executor.models.minimax_m2 import MiniMaxM2ForCausalLM, MiniMaxM2Model  # noqa: E402
from vllm.model_executor.models.utils import WeightsMapper  # noqa: E402
from vllm.transformers_utils.config import get_config  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

# the one rename vLLM's M3 loader does (vllm/models/minimax_m3/nvidia/model.py:973-976) and its M2 mapper lacks
SCALE_RENAME = WeightsMapper(orig_to_new_suffix={".weight_scale_inv": ".weight_scale"})


def build(art: Path, port: int):
    hf = get_config(str(art), trust_remote_code=False)
    qcfg = hf.quantization_config
    qc = get_quantization_config(qcfg["quant_method"]).from_config(qcfg)
    configure_quant_config(qc, MiniMaxM2ForCausalLM)
    vc = VllmConfig()
    model_config = m3h._ModelConfig(
        hf_text_config=hf,
        hf_config=hf,
        dtype=hf.dtype,  # the checkpoint's (bfloat16), as vLLM's ModelConfig resolves "auto"
        use_mla=False,
        is_moe=True,
        get_num_layers=lambda *a: hf.num_hidden_layers,
        quantization=qcfg["quant_method"],
        multimodal_config=None,
        max_model_len=256,
        enforce_eager=True,
    )
    object.__setattr__(vc, "model_config", model_config)
    object.__setattr__(vc, "quant_config", qc)
    with m3h.building(vc, port):
        with set_default_torch_dtype(model_config.dtype):  # as vLLM's loader builds it
            model = MiniMaxM2ForCausalLM(vllm_config=vc, prefix="")
    return vc, model


# vLLM's module for each role of m2_common.modules (under `model.layers.{i}.`)
ENGINE_NAMES = {
    "qkv": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "experts": "block_sparse_moe.experts.routed_experts",
    "gate": "block_sparse_moe.gate",
}


def load(vc, model, weights) -> tuple[set, dict | None]:
    """vLLM's load_weights over `weights`: (names it reports loaded, the error it raised or None)."""
    with set_current_vllm_config(vc):
        try:
            return model.load_weights(iter(weights)), None
        except (ValueError, AttributeError, KeyError) as e:  # the report states it; the test asserts which
            return set(), {"type": type(e).__name__, "message": str(e)[:1000]}


def probes(vc, model, tensors: dict) -> dict:
    """Each of porter's `weight_scale_inv` tensors fed alone (the error it raises, None if it loads), and all
    other tensors fed together into a freshly filled model (their error and the parameters left unwritten)."""
    scales = {n for n in tensors if n.endswith(".weight_scale_inv")}
    each = {n: load(vc, model, [(n, tensors[n])])[1] for n in sorted(scales)}
    common.fill_sentinel(model)
    _, error = load(vc, model, [(n, t) for n, t in tensors.items() if n not in scales])
    left = [n for n, p in model.named_parameters() if not common.is_kv_scale(n) and common.sentinel_left(p)]
    return {"each_scale": each, "without_scales": {"error": error, "sentinel_left": left}}


def main(art: Path, report_path: Path, reference: Path, rename: bool) -> None:
    if rename:  # before the model is built: its __init__ extends the class mapper with the MTP drop
        MiniMaxM2Model.hf_to_vllm_mapper = MiniMaxM2Model.hf_to_vllm_mapper | SCALE_RENAME
    cfg, tensors = m2_common.read(art)
    vc, model = build(art, int(os.environ.get("PORTER_ENGINE_PORT", "29557")))
    common.fill_sentinel(model)
    loaded, error = load(vc, model, tensors.items())
    params = dict(model.named_parameters())
    head = {
        "engine": "vllm",
        "error": error,
        "quant_config": type(vc.quant_config).__name__,
        "loaded": sorted(loaded),
        "not_loaded": sorted(n for n in set(params) - set(loaded) if not common.is_kv_scale(n)),
    }
    want = m2_common.read(reference)[1] if reference else tensors
    m2_common.write_report(report_path, head, cfg, params, tensors, want, ENGINE_NAMES)
    if error is not None:
        report = json.loads(report_path.read_text()) | probes(vc, model, tensors)
        report_path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    args = m2_common.arguments(__doc__, "--rename-scales")
    main(args.artifact, args.report, args.reference, args.rename_scales)
