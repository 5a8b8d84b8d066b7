"""MoE backends behind one contract (runtime.moe.contract.MoeQuantInfo / MoeRouting), and their selection.

Every backend class has: `name`, `__init__(quant, routing)` (all layout work happens here, at load),
`__call__(hidden [T, H]) -> routed output [T, H]` (routed_scaling_factor applied exactly once), and
`forward_topk(hidden, topk_ids, topk_weights)` for externally computed routing, plus a classmethod
`check_supported(device) -> None` that raises BackendUnavailable with a one-line reason. The backends
import only the contract; this module sits above them and picks one.

Numerics (`moe_numerics`, docs/moe-backends.md "Serving numerics"): the torch reference computes "w8a16"
(weights dequantized, activations as given; the default) or "serving" (the layer input and the SwiGLU
output quantized to MXFP8 as FlashInfer's TRT-LLM kernel does). flashinfer-trtllm always computes
"serving"; triton its own (docs/moe-backends.md). None means the backend's own.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from runtime.moe.contract import (
    MOE_NUMERICS,
    TRTLLM_CAPABILITIES,
    BackendUnavailable,
    MoeQuantInfo,
    MoeRouting,
    check_numerics,
    check_numerics_name,
)
from runtime.moe.flashinfer_trtllm import TrtllmMoE
from runtime.moe.torch_backend import TorchMoE
from runtime.moe.triton import TritonMoE

__all__ = [
    "BACKENDS",
    "MOE_NUMERICS",
    "BackendUnavailable",
    "TRTLLM_CAPABILITIES",
    "check_numerics",
    "check_numerics_name",
    "make_moe",
    "resolve_backend",
]

log = logging.getLogger("porter.runtime")

BACKENDS = ("auto", "torch", "triton", "flashinfer-trtllm")
TRITON_MIN = (8, 0)  # bf16 MMA; the FP8 prefill path inside the backend needs SM89+ and checks itself
_CLASSES = {cls.name: cls for cls in (TorchMoE, TritonMoE, TrtllmMoE)}


def _backend_class(name: str):
    if name not in _CLASSES:
        raise BackendUnavailable(f"unknown MoE backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return _CLASSES[name]


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
        elif cap >= TRITON_MIN and _importable("triton"):  # Ampere, Ada, Hopper, Blackwell without flashinfer
            need = "; install flashinfer-python for the TRT-LLM kernels" if cap in TRTLLM_CAPABILITIES else ""
            choice, why = "triton", f"{sm} with triton installed{need}"
        else:
            choice, why = "torch", f"{sm}: porter's kernels need SM80+ and triton"
    _backend_class(choice).check_supported(device)
    log.info("MoE backend: %s (auto: %s)", choice, why)
    return choice


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def make_moe(name: str, quant: MoeQuantInfo, routing: MoeRouting, numerics=None, fp8_prefill: bool = True):
    """The backend `name` for one layer. numerics: see the module docstring; fp8_prefill: the Triton
    backend's FP8 prefill path (TritonMoE)."""
    check_numerics(numerics, name)
    if name == "triton":
        return TritonMoE(quant, routing, fp8_prefill=fp8_prefill, numerics=numerics)
    if name == "torch" and numerics is not None:
        return _backend_class(name)(quant, routing, numerics=numerics)
    return _backend_class(name)(quant, routing)
