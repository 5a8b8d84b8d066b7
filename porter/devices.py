"""Device and dtype arguments, checked where they enter (runtime.load and every command) with one rule."""

from __future__ import annotations

import logging

import torch

from porter.errors import DeviceError

log = logging.getLogger("porter")

DEVICE_HELP = "auto (a CUDA GPU when there is one, else cpu), cpu, cuda or cuda:N"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec="auto") -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' | torch.device -> a torch.device that exists on this machine."""
    if isinstance(spec, torch.device):
        dev = spec
    elif isinstance(spec, str) and spec.strip().lower() == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        log.debug("device auto: %s", dev)
    else:
        try:
            dev = torch.device(spec.strip() if isinstance(spec, str) else spec)
        except (RuntimeError, TypeError, ValueError):
            raise DeviceError(f"device {spec!r} is not a device; use {DEVICE_HELP}") from None
    if dev.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {spec!r}: porter runs on cpu or cuda; use {DEVICE_HELP}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {spec!r}: no CUDA GPU is visible to torch on this machine; use cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and not 0 <= dev.index < count:
            raise DeviceError(
                f"device {spec!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
            )
    return dev


def resolve_dtype(spec, device: torch.device) -> torch.dtype:
    """None | 'auto' | 'float32' | 'bfloat16' | 'float16' | torch.dtype -> the compute dtype
    (auto: float32 on CPU, bfloat16 on CUDA)."""
    if spec is None or (isinstance(spec, str) and spec.lower() == "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(spec, torch.dtype) and spec in DTYPES.values():
        return spec
    if isinstance(spec, str) and spec.lower().removeprefix("torch.") in DTYPES:
        return DTYPES[spec.lower().removeprefix("torch.")]
    raise DeviceError(f"dtype {spec!r} is not a compute dtype porter runs; use auto, {', '.join(DTYPES)}")
