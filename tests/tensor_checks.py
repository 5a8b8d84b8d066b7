"""Helpers the tests share for reading shards, comparing tensors byte for byte, and running the --device cuda
quantize path on the CPU."""
import contextlib
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


def cuda_quantize_path_on_cpu(monkeypatch) -> None:
    """Route every tensor through Pipeline._quantize_cuda (the --device cuda code: stream, staged copies, stats
    gathered in one tensor), whole, with torch.cuda's stream stubbed so it runs on the CPU."""
    import porter.pipeline as pp

    class FakeStream:
        def __init__(self, device=None):
            pass

        def synchronize(self):
            pass
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def whole_on_device(self, w, name, keep=None):  # Pipeline._quantize's CUDA branch
        yield (0, *self._quantize_cuda(w, name, keep))
    monkeypatch.setattr(pp.Pipeline, "_quantize", whole_on_device)
