"""Helpers the tests share for reading shards and comparing tensors byte for byte."""
from pathlib import Path

import torch
from safetensors import safe_open


def load_all(d: Path) -> dict:
    """Every tensor of every *.safetensors file in folder d, by name."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included, unlike torch.equal on floats)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))
