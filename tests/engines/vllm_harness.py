"""vLLM 0.33.0: load porter's `--layout hf` artifact through vLLM's own MiniMax-M3 code on CPU.

    python tests/engines/vllm_harness.py ARTIFACT_DIR REPORT.json [ALL_LISTED.json]

Builds `vllm.models.minimax_m3.nvidia.model.MiniMaxM3SparseForCausalLM` under the prefix
`language_model` (exactly as the VL class `MiniMaxM3SparseForConditionalGeneration` builds it) with the
real `ModelOptMxFp8Config` made from porter's config.json, and loads the artifact through vLLM's
`AutoWeightsLoader` (which routes `language_model.*` to the text model's own `load_weights`, as the VL
class does). The vision tower is not built (it needs image preprocessing stacks); its tensors are
skipped by prefix. What is patched (engine internals that need a GPU, none of the loading code):
`select_linear_kernel` (no MXFP8 linear kernel exists on CPU) and `ModelOptMxFp8FusedMoE.__init__` (skips
the GPU MoE backend choice; parameter registration is untouched).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_common as common  # noqa: E402  (imports transformers first)

common.stub_torchvision()

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
import vllm.model_executor.layers.quantization.modelopt as modelopt  # noqa: E402
from torch import nn  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment  # noqa: E402
from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config  # noqa: E402

VISION_PREFIXES = ["vision_tower.", "multi_modal_projector.", "patch_merge_mlp."]


class _NoKernel:
    supports_pre_processed_weights = False

    def process_weights_after_loading(self, layer):
        pass

    def input_quant_key(self):
        return None


def _moe_init(self, quant_config, moe_config):
    modelopt.FusedMoEMethodBase.__init__(self, moe_config)
    self.weight_block_size = [1, 32]
    self.quant_config = quant_config
    self.mxfp8_backend, self.experts_cls = None, None


@contextlib.contextmanager
def building(vc, port: int):
    """vLLM's single-process CPU setup for building a model under `vc`: the current config, a gloo process
    group of one, and the two GPU-only choices patched (the module docstring)."""
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        modelopt.select_linear_kernel = lambda *a, **k: _NoKernel()
        modelopt.ModelOptMxFp8FusedMoE.__init__ = _moe_init
        yield


class _ModelConfig(SimpleNamespace):
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return None


def build(config: dict, port: int):
    text = PretrainedConfig(**config["text_config"])
    qc = ModelOptMxFp8Config.from_config(config["quantization_config"])
    vc = VllmConfig()
    object.__setattr__(
        vc,
        "model_config",
        _ModelConfig(
            hf_text_config=text,
            hf_config=text,
            dtype=torch.bfloat16,
            use_mla=False,
            is_moe=True,
            get_num_layers=lambda *a: text.num_hidden_layers,
            quantization="mxfp8",
            multimodal_config=None,
            max_model_len=256,
            enforce_eager=True,
        ),
    )
    object.__setattr__(vc, "quant_config", qc)
    with building(vc, port):
        from vllm.model_executor.model_loader.utils import configure_quant_config
        from vllm.models.minimax_m3.nvidia.model import MiniMaxM3SparseForCausalLM

        configure_quant_config(qc, MiniMaxM3SparseForCausalLM)
        lm = MiniMaxM3SparseForCausalLM(vllm_config=vc, prefix="language_model")
    return vc, qc, lm


def quant_config(qcfg: dict):
    """As vLLM's loader makes it: from_config, then the model class's packed modules."""
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.models.minimax_m3.nvidia.model import MiniMaxM3SparseForCausalLM

    qc = ModelOptMxFp8Config.from_config(qcfg)
    configure_quant_config(qc, MiniMaxM3SparseForCausalLM)
    return qc


class Wrapper(nn.Module):
    """The VL class's weight routing without its vision tower: `language_model.*` -> the text model."""

    def __init__(self, lm):
        super().__init__()
        self.language_model = lm

    def load_weights(self, weights):
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self, ignore_unexpected_prefixes=VISION_PREFIXES).load_weights(weights)


# vLLM's module for each role of engine_common.engine_modules (under `model.layers.{i}.`): the indexer's q/k
# rows join qkv_proj
ENGINE_NAMES = {
    "qkv": "self_attn.qkv_proj",
    "index_qk": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "experts": "block_sparse_moe.experts",
    "shared_gate_up": "block_sparse_moe.shared_experts.gate_up_proj",
    "shared_down": "block_sparse_moe.shared_experts.down_proj",
    "gate": "block_sparse_moe.gate",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}


def row_checks(params: dict, tensors: dict, cfg: dict) -> tuple[int, list]:
    """Byte-compare fused q|k|v(|index_q|index_k) and expert rows (weights and uint8 scales) with porter's."""
    t = cfg["text_config"]
    sparse = t["sparse_attention_config"]["sparse_attention_freq"]
    checked, bad = 0, []

    def cmp(label, got, want):
        nonlocal checked
        checked += 1
        if not common.same_bytes(got, want):
            bad.append(label)

    for layer in range(t["num_hidden_layers"]):
        p = f"language_model.model.layers.{layer}."
        qkv = ["q", "k", "v"] + (["index_q", "index_k"] if sparse[layer] else [])
        for suffix, param_suffix in ((".weight", ".weight"), (".weight_scale_inv", ".weight_scale")):
            if p + "self_attn.q_proj" + suffix not in tensors:
                continue
            fused = params[p + "self_attn.qkv_proj" + param_suffix].data
            row = 0
            for x in qkv:
                want = tensors[p + f"self_attn.{x}_proj" + suffix]
                cmp(
                    f"{p}self_attn.qkv_proj{param_suffix} rows of {x}_proj",
                    fused[row : row + want.shape[0]],
                    want,
                )
                row += want.shape[0]
            checked += 1
            if row != fused.shape[0]:
                bad.append(
                    f"{p}self_attn.qkv_proj{param_suffix}: {fused.shape[0]} rows, porter's parts {row}"
                )
        if t["moe_layer_freq"][layer]:
            m = p + "block_sparse_moe.experts."
            for suffix, param_suffix in ((".weight", "_weight"), (".weight_scale_inv", "_weight_scale")):
                if m + "0.w1" + suffix not in tensors:
                    continue
                w13 = params[m + "routed_experts.w13" + param_suffix].data
                w2 = params[m + "routed_experts.w2" + param_suffix].data
                for e in range(t["num_local_experts"]):
                    w1, w3 = tensors[m + f"{e}.w1" + suffix], tensors[m + f"{e}.w3" + suffix]
                    cmp(f"{m}w13{param_suffix}[{e}] = [w1; w3]", w13[e], torch.cat([w1, w3]))
                    cmp(f"{m}w2{param_suffix}[{e}]", w2[e], tensors[m + f"{e}.w2" + suffix])
    return checked, bad


def main(art: Path, report_path: Path, all_listed: list) -> None:
    cfg = json.loads((art / "config.json").read_text())
    tensors = common.load_all(art)
    vc, qc, lm = build(cfg, int(os.environ.get("PORTER_ENGINE_PORT", "29555")))
    model = Wrapper(lm)
    common.fill_sentinel(model)
    with set_current_vllm_config(vc):
        loaded = model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    not_loaded = sorted(n for n in set(params) - set(loaded) if not common.is_kv_scale(n))
    sentinel = {n: common.sentinel_left(p) for n, p in params.items() if not common.is_kv_scale(n)}
    qc_all = quant_config({**cfg["quantization_config"], "ignored_layers": all_listed})

    def weight(prefix):
        return params.get(
            prefix + ".routed_experts.w13_weight" if prefix.endswith("experts") else prefix + ".weight"
        )

    ignore = common.ignore_records(
        cfg,
        ENGINE_NAMES,
        lambda p: bool(qc.is_layer_excluded(p)),
        lambda p: bool(qc_all.is_layer_excluded(p)),
        weight,
    )
    head = {"engine": "vllm", "params": len(params), "loaded": len(loaded), "not_loaded": not_loaded}
    common.write_report(
        report_path, head, params, sentinel, tensors, ignore, row_checks(params, tensors, cfg)
    )


if __name__ == "__main__":
    extra = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else []
    main(Path(sys.argv[1]), Path(sys.argv[2]), extra)
