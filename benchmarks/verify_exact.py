"""Throughput of `porter verify`'s exact re-derivation at MiniMax-M3's real expert dims (H 6144, I 3072).

Builds a synthetic vendor-layout checkpoint (layer 0 dense, then MoE layers of E experts; fewer experts
and layers than the real model, same per-expert shapes), converts it, then times within one run:
- floor: a plain read of every source tensor and every artifact tensor it re-derives from / compares to
  (safetensors get_tensor + a sum to touch every byte; page cache warm for both);
- the re-derivation (porter.commands.verify.exact.rederive) on each requested device.
Reports seconds, source GB/s and the ratio to the floor, plus the estimate verify logs before starting.

    python benchmarks/verify_exact.py [--layers 2] [--experts 8] [--devices cpu,cuda] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import porter  # noqa: E402
from porter.commands.verify.exact import rederive  # noqa: E402
from porter.commands.verify.mapping import ArtifactReader, Mapping, SourceShards  # noqa: E402
from tiny_checkpoint import build_tiny_checkpoint, synthetic_overrides  # noqa: E402


def plain_read(src: Path, art: Path, man: dict) -> float:
    """Seconds to read every source and artifact tensor once (the bytes floor of the comparison)."""
    from safetensors import safe_open
    t0 = time.perf_counter()
    for d in (src, art):
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for n in h.keys():
                    h.get_tensor(n).view(torch.uint8).sum()
    return time.perf_counter() - t0


def time_rederive(src: Path, art: Path, man: dict, device: str) -> dict:
    t0 = time.perf_counter()
    res = rederive(ArtifactReader(art, man), Mapping(SourceShards(src)), man["options"]["scale_rounding"],
                   torch.device(device))
    secs = time.perf_counter() - t0
    assert res.passed, [t for t in res.tensors if not t.exact]
    return {"seconds": secs, "bytes_read": res.bytes_read, "blocks": sum(t.blocks for t in res.tensors if t.quantized)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--devices", default="cpu" + (",cuda" if torch.cuda.is_available() else ""))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        src = build_tiny_checkpoint(Path(tmp) / "src", text_overrides=synthetic_overrides(
            args.layers, hidden=6144, intermediate=3072, experts=args.experts), max_shard_tensors=16)
        art = Path(tmp) / "art"
        porter.convert(src, art, progress=False)
        man = json.loads((art / "porter.json").read_text())
        plain_read(src, art, man)  # warm the page cache
        floor = min(plain_read(src, art, man) for _ in range(2))
        rows = {d: time_rederive(src, art, man, d) for d in args.devices.split(",")}
    src_gb = rows[next(iter(rows))]["bytes_read"] / 1e9
    out = {"hardware": {"cpu_cores": os.cpu_count(), "platform": platform.platform(),
                        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
           "versions": {"torch": torch.__version__, "python": platform.python_version()},
           "shape": {"hidden": 6144, "intermediate": 3072, "experts": args.experts, "layers": args.layers},
           "bytes_read_gb": src_gb, "floor_seconds": floor,
           "devices": {d: r | {"gb_per_s": src_gb / r["seconds"], "x_floor": r["seconds"] / floor}
                       for d, r in rows.items()}}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
