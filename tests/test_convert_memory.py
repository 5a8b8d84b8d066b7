"""Peak RSS of `porter convert` must not grow with the checkpoint's total size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_checkpoint import build_tiny_checkpoint, synthetic_overrides

ROOT = Path(__file__).resolve().parents[1]
MEASURE = """
import json, sys
sys.path.insert(0, {root!r})
import porter
dry = porter.convert(sys.argv[1], sys.argv[2], max_shard_size="200MB", dry_run=True, max_memory="1.5GB")
porter.convert(sys.argv[1], sys.argv[2], max_shard_size="200MB", progress=False, max_memory="1.5GB")
# VmHWM is this process's own peak; ru_maxrss would carry the parent's peak across fork+exec
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({{"peak_rss_kb": int(hwm), "estimate": dry["peak_bytes_estimate"]}}))
"""


def peak_rss_of_convert(src: Path, out: Path) -> tuple[int, int]:
    """(peak RSS, --dry-run's estimate) of a conversion in a fresh process, bytes."""
    res = subprocess.run(
        [sys.executable, "-c", MEASURE.format(root=str(ROOT)), str(src), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return doc["peak_rss_kb"] * 1024, doc["estimate"]


@pytest.mark.slow
def test_peak_rss_independent_of_model_size(tmp_path):
    # 3 vs 9 layers: ~0.23 GB vs ~0.9 GB of bf16 source, 16 experts of 3 x [1024, 1024] per MoE layer.
    small = build_tiny_checkpoint(
        tmp_path / "small", text_overrides=synthetic_overrides(3), max_shard_tensors=64
    )
    large = build_tiny_checkpoint(
        tmp_path / "large", text_overrides=synthetic_overrides(9), max_shard_tensors=64
    )
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert 3.5 < size(large) / size(small) < 4.5
    (rss_small, est_small), (rss_large, est_large) = (
        peak_rss_of_convert(d, tmp_path / f"o_{d.name}") for d in (small, large)
    )
    # holding the whole model would add ~0.6 GB (> 100% of the small run's peak); streaming adds nothing
    assert abs(rss_large - rss_small) / rss_small < 0.15, (rss_small, rss_large)
    # within the budget, and --dry-run's estimate within 1.5x of what was measured
    assert max(rss_small, rss_large) < 1.5e9
    for rss, est in ((rss_small, est_small), (rss_large, est_large)):
        assert 1 / 1.5 < est / rss < 1.5, (est, rss)


def test_default_budget_is_this_process_plus_half_the_available(monkeypatch):
    """The budget caps the process's peak; the pages it holds already are not in MemAvailable."""
    from porter.engine import budget

    status = {"RssAnon": 600 << 20, "RssFile": 100 << 20, "MemAvailable": 200 << 20, "MemTotal": 16 << 30}
    monkeypatch.setattr(budget, "memory_status", lambda: status)
    assert budget.default_max_memory() == (700 << 20) + (100 << 20)


def test_a_small_conversion_fits_a_busy_machine(tiny_vendor, tmp_path, monkeypatch):
    """64 MB available (another process holds the rest): the 1 MB checkpoint converts with the default budget,
    which counts this process as resident and the read-back buffers as the plan's largest tensor (the part of a
    16 MiB chunk buffer a hash touches)."""
    import porter
    import porter.engine
    from porter.engine import budget
    from porter.format.safetensors_io import DIGEST_CHUNK_BYTES, parse_header

    real = budget.memory_status
    monkeypatch.setattr(porter.engine, "default_max_memory", budget.default_max_memory)  # not conftest's pin
    monkeypatch.setattr(budget, "memory_status", lambda: {**real(), "MemAvailable": 64 << 20})
    dry = porter.convert(tiny_vendor, tmp_path / "o", dry_run=True, device="cpu", workers=3)
    est = dry["memory_estimate"]
    assert est["max_memory"] - est["base"] < 64 << 20  # the budget beyond this process: half of 64 MB
    done = porter.convert(tiny_vendor, tmp_path / "o", progress=False, device="cpu", workers=3)
    assert done["tensors"] == 82 and (tmp_path / "o" / "model.safetensors.index.json").exists()
    written = [
        info["data_offsets"][1] - info["data_offsets"][0]
        for f in (tmp_path / "o").glob("*.safetensors")
        for info in parse_header(f)[1].values()
    ]
    assert est["readback"] == 3 * max(written) < 3 * DIGEST_CHUNK_BYTES  # each worker: the largest tensor
