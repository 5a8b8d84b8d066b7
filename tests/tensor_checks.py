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
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def cuda_quantize_path_on_cpu(monkeypatch) -> None:
    """Route every tensor through CudaQuantizer.quantize (the --device cuda code: stream, staged copies, stats
    gathered in one tensor), whole, with torch.cuda's stream stubbed so it runs on the CPU."""
    import porter.engine.run as pp

    class FakeStream:
        def __init__(self, device=None):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def whole_on_device(self, w, name, keep=None):  # Pipeline._quantize's CUDA branch
        yield (0, *self.gpu.quantize(w, name, keep))

    monkeypatch.setattr(pp.Pipeline, "_quantize", whole_on_device)


def chunk_hash(name: str):
    """A chunk hash by the name porter.json's digest rule gives it, from the hash libraries directly (not
    through porter.format.safetensors_io's table)."""
    import hashlib

    import xxhash

    return {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}[name]


def chunked_digest(data: bytes, chunk: int = 16 << 20, hash_name: str = "xxh3-128") -> str:
    """porter's tensor digest written out independently (docs/artifact-format.md, "Digests"): sha256 of the
    concatenated chunk-hash digests of the data's chunks."""
    import hashlib

    h = chunk_hash(hash_name)
    return hashlib.sha256(
        b"".join(h(data[i : i + chunk]).digest() for i in range(0, len(data), chunk))
    ).hexdigest()


def shard_digests(path: Path, chunk: int = 16 << 20, hash_name: str = "xxh3-128") -> tuple:
    """(header sha256, {tensor: digest}, shard digest) of a safetensors file, by the same rule."""
    import hashlib
    import json

    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    tensors = {
        k: chunked_digest(raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]], chunk, hash_name)
        for k, v in header.items()
    }
    head = hashlib.sha256(raw[: 8 + n]).digest()
    return (
        head.hex(),
        tensors,
        hashlib.sha256(head + b"".join(bytes.fromhex(d) for d in tensors.values())).hexdigest(),
    )
