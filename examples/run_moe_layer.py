"""Load one MoE layer of a porter artifact (converted shards) and run it on its own.

Runs the routed experts through the chosen backend and through the torch reference backend on the same
random hidden states, and prints shapes and the max abs difference. Only that layer's tensors are read
(memory-mapped from the shards).

    python examples/run_moe_layer.py ARTIFACT_DIR --layer 3 --backend auto --device cuda --tokens 64
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import models  # noqa: E402
from runtime.loader import getter, open_store  # noqa: E402
from runtime.moe import make_moe, resolve_backend  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", help="porter artifact dir (or an original checkpoint dir)")
    ap.add_argument("--layer", type=int, default=None, help="MoE layer index (default: the first MoE layer)")
    ap.add_argument("--backend", default="auto", help="auto | torch | triton | flashinfer-trtllm")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 CPU, bf16 CUDA"
    )
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    store = open_store(args.artifact)
    cfg, runtime_model = store.config, models.for_store(store)  # the architecture's runtime model module
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    layer = moe_layers[0] if args.layer is None else args.layer
    if layer not in moe_layers:
        ap.error(f"layer {layer} is not a MoE layer; MoE layers: {moe_layers[0]}..{moe_layers[-1]}")
    name = resolve_backend(
        args.backend, device, quantized=runtime_model.experts_quantized(cfg, store.names())
    )

    get = getter(store, store.names(), device)
    canonical = []  # the canonical tensors as loaded: a backend that rebases them at load keeps no reference

    def backend(q, r):
        canonical.append(q)
        return make_moe(name, q, r)

    moe = runtime_model.moe_block(cfg, get, layer, device, backend)
    q = canonical[0]
    reference = make_moe("torch", q, moe.routing)

    x = torch.randn(args.tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(args.seed))
    x = x.to(device=device, dtype=dtype)  # [T, H]
    print(
        f"layer {layer}: w13 {tuple(q.w13_weight.shape)} {q.w13_weight.dtype}, "
        f"w2 {tuple(q.w2_weight.shape)} {q.w2_weight.dtype}, "
        f"scales {None if q.w13_weight_scale is None else tuple(q.w13_weight_scale.shape)}"
    )
    print(
        f"swiglu per expert: alpha {q.gemm1_alpha[0].item():g}, beta {q.gemm1_beta[0].item():g}, "
        f"limit {q.gemm1_clamp_limit[0].item():g} (shape {tuple(q.gemm1_alpha.shape)}, {q.gemm1_alpha.dtype})"
    )
    with torch.inference_mode():
        routed = moe.experts(x)  # [T, H], routed_scaling_factor applied
        want = reference(x)
        block = moe(x)  # routed + shared expert
    diff = (routed.float() - want.float()).abs().max().item()
    print(
        f"input {tuple(x.shape)} {x.dtype} -> routed {tuple(routed.shape)}, block output {tuple(block.shape)}"
    )
    print(
        f"backend {name} vs torch: max abs diff {diff:.3e} (max abs torch output {want.abs().max().item():.3e})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
