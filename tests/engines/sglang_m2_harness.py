"""sglang 0.5.23: load porter's MiniMax-M2 `--layout hf` artifact through sglang's own `MiniMaxM2ForCausalLM`
on CPU.

    python tests/engines/sglang_m2_harness.py ARTIFACT_DIR REPORT.json [--reference PORTER_ARTIFACT_DIR]

As sglang's loader does: the config from sglang's own `get_config` over the artifact folder, the quantization
config from its registry for porter's `quant_method` ("mxfp8" -> `Fp8Config`) with the class's
`packed_modules_mapping`, the model built under the config's dtype, then every tensor through the class's own
`load_weights`. Nothing in sglang is patched (the `vllm._custom_ops` stand-in of sglang_harness.py exists only
because sglang's RoPE imports it off-CUDA). sglang skips a name with no parameter silently, so only the
sentinel fill shows whether everything was written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_common as common  # noqa: E402  (imports transformers first)
import m2_common  # noqa: E402
import sglang_harness as m3h  # noqa: E402  (stubs torchvision and vllm._custom_ops, imports sglang)
from sglang.srt.layers.quantization import get_quantization_config  # noqa: E402
from sglang.srt.model_loader.utils import set_default_torch_dtype  # noqa: E402
from sglang.srt.models.minimax_m2 import MiniMaxM2ForCausalLM  # noqa: E402
from sglang.srt.utils.hf_transformers.config import get_config  # noqa: E402

# sglang's module for each role of m2_common.modules (under `model.layers.{i}.`)
ENGINE_NAMES = {
    "qkv": "self_attn.qkv_proj",
    "o_proj": "self_attn.o_proj",
    "experts": "block_sparse_moe.experts",
    "gate": "block_sparse_moe.gate",
}


def main(art: Path, report_path: Path, reference: Path) -> None:
    cfg, tensors = m2_common.read(art)
    hf = get_config(str(art), trust_remote_code=False)
    qcfg = dict(hf.quantization_config)
    qcfg["packed_modules_mapping"] = dict(MiniMaxM2ForCausalLM.packed_modules_mapping)
    qc = get_quantization_config(qcfg["quant_method"]).from_config(qcfg)
    m3h.init_dist(int(os.environ.get("PORTER_ENGINE_PORT", "29635")))
    with set_default_torch_dtype(hf.dtype):  # as sglang's loader builds it
        model = MiniMaxM2ForCausalLM(hf, qc, prefix="")
    common.fill_sentinel(model)
    loaded = model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    head = {
        "engine": "sglang",
        "error": None,
        "quant_config": type(qc).__name__,
        "loaded": sorted(loaded),
        "not_loaded": sorted(n for n in set(params) - set(loaded) if not common.is_kv_scale(n)),
    }
    want = m2_common.read(reference)[1] if reference else tensors
    m2_common.write_report(report_path, head, cfg, params, tensors, want, ENGINE_NAMES)


if __name__ == "__main__":
    args = m2_common.arguments(__doc__)
    main(args.artifact, args.report, args.reference)
