"""sglang 0.5.23: load porter's `--layout hf` artifact through sglang's own MiniMax-M3 VL class on CPU.

    python tests/engines/sglang_harness.py ARTIFACT_DIR REPORT.json [ALL_LISTED.json]

Builds `sglang.srt.models.minimax_m3_vl.MiniMaxM3SparseForConditionalGeneration` (the class the vendor
`architectures` names) from porter's config.json with the real `Fp8Config` (MXFP8) made from its top-level
quantization_config, the class's packed_modules_mapping and hf_to_sglang_mapper (as sglang's loader does),
then feeds every artifact tensor to the class's own `load_weights`. Nothing in sglang is patched; a
`vllm._custom_ops` stand-in is installed only because sglang's RoPE imports it off-CUDA. Checks cover the
text model (`model.*`, `lm_head.*` parameters); the tiny vision tensors are random and not checked.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_common as common  # noqa: E402  (imports transformers first)

common.stub_torchvision()

from transformers import PretrainedConfig  # noqa: E402

_vllm = types.ModuleType("vllm")
_ops = types.ModuleType("vllm._custom_ops")
_ops.rotary_embedding = lambda *a, **k: None
_vllm._custom_ops = _ops
sys.modules.setdefault("vllm", _vllm)
sys.modules.setdefault("vllm._custom_ops", _ops)

from sglang.srt.layers.quantization.fp8 import Fp8Config  # noqa: E402
from sglang.srt.layers.quantization.utils import is_layer_skipped  # noqa: E402
from sglang.srt.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration as VL  # noqa: E402


def init_dist(port: int) -> None:
    for k, v in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        os.environ.setdefault(k, v)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1, device="cpu"),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")


def quant_config(qcfg: dict) -> Fp8Config:
    """As sglang's loader makes it: from_config, the class's packed modules, its name mapper."""
    c = dict(qcfg)
    c["packed_modules_mapping"] = dict(VL.packed_modules_mapping)
    qc = Fp8Config.from_config(c)
    qc.apply_weight_name_mapper(VL.hf_to_sglang_mapper)
    return qc


# The tiny checkpoint's vision_config is a stand-in with a few keys; sglang's CLIP config needs all of these.
TINY_VISION_DEFAULTS = {
    "intermediate_size": 64,
    "num_channels": 3,
    "image_size": 28,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "img_token_compression_config": {},
    "position_embedding_type": "rope",
    "rope_mode": "3d",
    "rope_theta": 10000.0,
    "vision_segment_max_frames": None,
}


def hf_config(cfg: dict) -> PretrainedConfig:
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "quantization_config")}
    return PretrainedConfig(
        **top,
        text_config=PretrainedConfig(**cfg["text_config"]),
        vision_config=TINY_VISION_DEFAULTS | cfg["vision_config"],
        encoder_only=False,
    )


# sglang's module for each role of engine_common.engine_modules (under `model.layers.{i}.`)
ENGINE_NAMES = {
    "qkv": "self_attn.qkv_proj",
    "index_qk": "self_attn.index_qkv_proj",
    "o_proj": "self_attn.o_proj",
    "experts": "mlp.experts",
    "shared_gate_up": "mlp.shared_experts.gate_up_proj",
    "shared_down": "mlp.shared_experts.down_proj",
    "gate": "mlp.gate",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
}


def excluded(qc: Fp8Config, prefix: str) -> bool:
    return bool(is_layer_skipped(prefix, qc.ignored_layers, fused_mapping=qc.packed_modules_mapping))


def row_checks(model, tensors: dict, cfg: dict) -> tuple[int, list]:
    """Byte-compare fused q|k|v(|index_q|index_k) rows and expert rows (weights and uint8 scales)."""
    t = cfg["text_config"]
    sparse = t["sparse_attention_config"]["sparse_attention_freq"]
    mods = dict(model.named_modules())
    checked, bad = 0, []

    def cmp(label, fused, parts):
        nonlocal checked
        row = 0
        for name, want in parts:
            checked += 1
            if not common.same_bytes(fused[row : row + want.shape[0]], want):
                bad.append(f"{label} rows of {name}")
            row += want.shape[0]
        checked += 1
        if row != fused.shape[0]:
            bad.append(f"{label}: {fused.shape[0]} rows, porter's parts {row}")

    for layer in range(t["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        src = "language_model." + p
        attn = mods[p + "self_attn"]
        fused_holder = getattr(attn, "_fused_qkv_index", None)
        for suffix, attr in ((".weight", "weight"), (".weight_scale_inv", "weight_scale_inv")):
            if src + "self_attn.q_proj" + suffix not in tensors:
                continue
            qkv = [(x, tensors[src + f"self_attn.{x}_proj" + suffix]) for x in ("q", "k", "v")]
            idx = (
                [(x, tensors[src + f"self_attn.{x}_proj" + suffix]) for x in ("index_q", "index_k")]
                if sparse[layer]
                else []
            )
            if fused_holder is not None and idx:  # sglang fused qkv and index rows after loading
                cmp(f"{p}self_attn.fused_qkv_index_proj.{attr}", getattr(fused_holder, attr), qkv + idx)
            else:
                cmp(f"{p}self_attn.qkv_proj.{attr}", getattr(attn.qkv_proj, attr).data, qkv)
                if idx:
                    cmp(f"{p}self_attn.index_qkv_proj.{attr}", getattr(attn.index_qkv_proj, attr).data, idx)
        if t["moe_layer_freq"][layer]:
            experts = mods[p + "mlp.experts"]
            m = src + "block_sparse_moe.experts."
            for suffix, attr in ((".weight", "_weight"), (".weight_scale_inv", "_weight_scale_inv")):
                if m + "0.w1" + suffix not in tensors:
                    continue
                w13, w2 = getattr(experts, "w13" + attr).data, getattr(experts, "w2" + attr).data
                for e in range(t["num_local_experts"]):
                    cmp(
                        f"{p}mlp.experts.w13{attr}[{e}]",
                        w13[e],
                        [("w1", tensors[m + f"{e}.w1" + suffix]), ("w3", tensors[m + f"{e}.w3" + suffix])],
                    )
                    cmp(f"{p}mlp.experts.w2{attr}[{e}]", w2[e], [("w2", tensors[m + f"{e}.w2" + suffix])])
    return checked, bad


def main(art: Path, report_path: Path, all_listed: list) -> None:
    cfg = json.loads((art / "config.json").read_text())
    tensors = common.load_all(art)
    init_dist(int(os.environ.get("PORTER_ENGINE_PORT", "29633")))
    qc = quant_config(cfg["quantization_config"])
    model = VL(hf_config(cfg), qc, prefix="")
    common.fill_sentinel(model)
    model.load_weights(iter(tensors.items()))  # returns nothing: "written" is judged by the sentinel
    params = {n: p for n, p in model.named_parameters() if n.startswith(("model.", "lm_head."))}
    sentinel = {n: common.sentinel_left(p) for n, p in params.items() if not common.is_kv_scale(n)}
    qc_all = quant_config(
        {**cfg["quantization_config"], "ignored_layers": all_listed, "modules_to_not_convert": all_listed}
    )
    mods = dict(model.named_modules())

    def weight(prefix):
        module = mods.get(prefix.removeprefix("language_model."))
        return (
            getattr(module, "w13_weight", None)
            if prefix.endswith("experts")
            else getattr(module, "weight", None)
        )

    ignore = common.ignore_records(
        cfg, ENGINE_NAMES, lambda p: excluded(qc, p), lambda p: excluded(qc_all, p), weight
    )
    head = {
        "engine": "sglang",
        "params": len(params),
        "written": sum(1 for n, c in sentinel.items() if c == 0),
    }
    common.write_report(report_path, head, params, sentinel, tensors, ignore, row_checks(model, tensors, cfg))


if __name__ == "__main__":
    extra = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else []
    main(Path(sys.argv[1]), Path(sys.argv[2]), extra)
