"""Conversion throughput on a synthetic ~2 GB vendor-layout MiniMax-M3 checkpoint (issue #2).

Reports, within one run: wall time of `porter convert` divided by a plain safetensors read + write of
the same shards (the I/O floor every converter pays), GB/s of source consumed, and the peak RSS of
each (measured in child processes). Goal: ratio <= 1.5 on CPU.

    python benchmarks/convert_throughput.py [--layers 20] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

BASELINE = """
import resource, sys, time
from pathlib import Path
from safetensors.torch import load_file, save_file
src, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
t0 = time.perf_counter()
for f in sorted(src.glob("*.safetensors")):
    save_file(load_file(str(f)), str(out / f.name))
print(time.perf_counter() - t0, VMHWM())
"""

CONVERT = """
import resource, sys, time
sys.path.insert(0, {root!r})
import porter
t0 = time.perf_counter()
porter.convert(sys.argv[1], sys.argv[2], progress=False)
print(time.perf_counter() - t0, VMHWM())
"""
# peak RSS of the child itself (ru_maxrss would inherit the parent's peak across fork+exec)
HWM = 'VMHWM = lambda: int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1])\n'


def child(code: str, *args) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", HWM + code, *map(str, args)], capture_output=True, text=True, check=True)
    secs, rss_kb = out.stdout.split()
    return float(secs), int(rss_kb) * 1024


def drop_page_cache_hint(path: Path) -> None:
    """Read the files once so both runs start from the same (warm) page cache."""
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (20 -> ~2 GB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convert_throughput.json"))
    args = ap.parse_args()
    import torch
    from tiny_checkpoint import build_tiny_checkpoint, synthetic_overrides
    with tempfile.TemporaryDirectory(dir=ROOT / "benchmarks") as tmp:
        tmp = Path(tmp)
        src = build_tiny_checkpoint(tmp / "src", text_overrides=synthetic_overrides(args.layers),
                                    max_shard_tensors=96)
        src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        drop_page_cache_hint(src)
        runs = []
        for r in range(args.repeats):
            base_s, base_rss = child(BASELINE, src, tmp / f"copy{r}")
            conv_s, conv_rss = child(CONVERT.format(root=str(ROOT)), src, tmp / f"conv{r}")
            runs.append({"baseline_s": base_s, "convert_s": conv_s, "ratio": conv_s / base_s,
                         "baseline_peak_rss_gb": base_rss / 1e9, "convert_peak_rss_gb": conv_rss / 1e9})
            print(json.dumps(runs[-1]))
    best = min(runs, key=lambda x: x["ratio"])
    median = sorted(r["ratio"] for r in runs)[len(runs) // 2]
    result = {"source_gb": src_bytes / 1e9, "layers": args.layers, "runs": runs, "best_ratio": best["ratio"],
              "median_ratio": median,
              "convert_gb_per_s": src_bytes / 1e9 / best["convert_s"],
              "baseline_gb_per_s": src_bytes / 1e9 / best["baseline_s"],
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": __import__("os").cpu_count(),
                          "python": platform.python_version(), "torch": torch.__version__,
                          "torch_threads": torch.get_num_threads()},
              "date": time.strftime("%Y-%m-%d")}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"source {result['source_gb']:.2f} GB: convert {best['convert_s']:.2f} s "
          f"({result['convert_gb_per_s']:.2f} GB/s), read+write {best['baseline_s']:.2f} s "
          f"({result['baseline_gb_per_s']:.2f} GB/s), ratio {best['ratio']:.2f} best / {median:.2f} median "
          f"of {len(runs)} (goal <= 1.5); "
          f"peak RSS convert {best['convert_peak_rss_gb']:.2f} GB vs read+write {best['baseline_peak_rss_gb']:.2f} GB")


if __name__ == "__main__":
    main()
