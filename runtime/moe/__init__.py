"""MoE backends behind one contract (runtime.moe.contract.MoeQuantInfo / MoeRouting).

Every backend class has: `name`, `__init__(quant, routing)` (all layout work happens here, at load),
`__call__(hidden [T, H]) -> routed output [T, H]` (routed_scaling_factor applied exactly once), and
`forward_topk(hidden, topk_ids, topk_weights)` for externally computed routing, plus a classmethod
`check_supported(device) -> None` that raises BackendUnavailable with a one-line reason.
"""
from __future__ import annotations

import logging

import torch

from runtime.moe.contract import MoeQuantInfo, MoeRouting
from porter.errors import BackendUnavailable

log = logging.getLogger("porter.runtime")

BACKENDS = ("auto", "torch", "triton", "flashinfer-trtllm")
TRTLLM_CAPABILITIES = ((10, 0), (10, 3), (10, 7))
HOPPER = (9, 0)


def _backend_class(name: str):
    if name == "torch":
        from runtime.moe.torch_backend import TorchMoE
        return TorchMoE
    if name == "triton":
        from runtime.moe.triton_backend import TritonMoE
        return TritonMoE
    if name == "flashinfer-trtllm":
        from runtime.moe.flashinfer_trtllm import TrtllmMoE
        return TrtllmMoE
    raise BackendUnavailable(f"unknown MoE backend {name!r}; choose one of {', '.join(BACKENDS)}")


def resolve_backend(name: str, device: torch.device, quantized: bool = True) -> str:
    """Pick (auto) or check (explicit) a backend for this device. Never falls back silently."""
    device = torch.device(device)
    if name != "auto":
        _backend_class(name).check_supported(device)
        return name
    if device.type != "cuda" or not quantized:
        choice, why = "torch", ("device is " + device.type) if quantized else "weights are not MXFP8"
    else:
        cap = torch.cuda.get_device_capability(device)
        sm = f"SM{cap[0]}{cap[1]}"
        if cap in TRTLLM_CAPABILITIES and _importable("flashinfer"):
            choice, why = "flashinfer-trtllm", f"{sm} with flashinfer installed"
        elif cap == HOPPER and _importable("triton"):
            choice, why = "triton", f"{sm} (Hopper) with triton installed"
        else:
            hint = " (backend='triton' also runs on SM80+)" if cap >= (8, 0) and _importable("triton") else ""
            need = " (install flashinfer-python for the TRT-LLM kernels)" if cap in TRTLLM_CAPABILITIES else ""
            choice, why = "torch", f"{sm}: no tuned backend for this GPU{need}{hint}"
    _backend_class(choice).check_supported(device)
    log.info("MoE backend: %s (auto: %s)", choice, why)
    return choice


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def make_moe(name: str, quant: MoeQuantInfo, routing: MoeRouting):
    return _backend_class(name)(quant, routing)
