"""runtime.load memory-maps the shards and keeps no second copy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_checkpoint import build_tiny_checkpoint, synthetic_overrides

import porter

ROOT = Path(__file__).resolve().parents[1]
MEASURE = """
import json, sys, torch
sys.path.insert(0, {root!r})
rss = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]) * 1024
import runtime
before = rss()
model = runtime.load(sys.argv[1])
loaded = rss()
logits = model(torch.tensor([[1, 5, 9, 13]]))
print(json.dumps({{"load_bytes": loaded - before, "finite": bool(torch.isfinite(logits).all())}}))
"""


@pytest.mark.slow
def test_load_maps_shards_without_copying(tmp_path):
    src = build_tiny_checkpoint(tmp_path / "src", text_overrides=synthetic_overrides(4), max_shard_tensors=64)
    art = tmp_path / "art"
    porter.convert(src, art, progress=False)
    size = sum(f.stat().st_size for f in art.glob("*.safetensors"))
    assert size > 100e6
    res = subprocess.run(
        [sys.executable, "-c", MEASURE.format(root=str(ROOT)), str(art)],
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["finite"]
    # a copy (or a dequantized/cast copy) would add >= 100% of the artifact; mapping adds almost nothing
    assert out["load_bytes"] < 0.1 * size, (out["load_bytes"], size)
