"""Conversion throughput and memory at a family's real layer dims, CPU and GPU, against a plain copy.

For each checkpoint size (--family m3: synthetic vendor-layout MiniMax-M3 with H 6144, I 3072, 64 q / 4 kv
heads of 128, indexer 4x128; m2-fp8: MiniMax-M2's FP8-block release format, H 3072, I 1536, 48 q / 8 kv heads
of 128, e4m3 weights with a float32 scale per 128x128 block, which porter dequantizes and re-quantizes;
m2-bf16: the same M2 layers in bf16; --experts per layer instead of the real 128 / 256; random weights), from
a warm page cache and (--cache cold) from disk, each run in a fresh process:

- baselines (the floor): safetensors `load_file` + `save_file` of every shard (what any converter pays to
  read and write the bytes), a raw file copy (`shutil.copyfile`, the I/O floor), each also with fsync of
  every output (porter syncs its shards before it writes the index, so the durable copy is the fair floor
  from disk: an unsynced copy stops its clock with most of its output still in the page cache);
- `porter convert` on the CPU (`--workers` = every core, and 1 worker with torch's intra-op threads) and
  with `--device cuda` when there is a GPU;
- per run: seconds, GB/s of source consumed, ratio to each baseline of the same cache state, peak memory
  (RssAnon / RssFile / VmHWM sampled every 20 ms), `--dry-run`'s memory estimate over the measured peak,
  the final fsync's seconds, whether the output is byte-identical to the CPU conversion, and the projected
  time for the 795 GB release at the measured rate.

Output shards are 512MB by default (--max-shard-size), not porter's 5GB: the release's ~430 GB of output is
~86 shards of 5 GB, so its conversion always has several shards open; an 8 GB checkpoint at 5 GB shards
would measure a one-file regime the real run never sees.

Cold: before each run the page cache is emptied (`echo 3 > /proc/sys/vm/drop_caches` as root; otherwise the
source files' pages are evicted with posix_fadvise(DONTNEED)). Between runs the last output is deleted and
synced, so no run pays for the previous one's writeback.

    python benchmarks/convert.py [--sizes 2,8] [--devices cpu,cuda] [--cache warm,cold] [--repeats 1]
                                 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402,F401  (evict, cached_fraction: the child processes call them from here)
    DEFAULT_OUT,
    ROOT,
    build_checkpoint,
    cached_fraction,
    environment,
    environment_line,
    evict,
    warm,
)

REAL_CHECKPOINT_GB = 795.0  # MiniMax-M3 BF16 release, safetensors bytes
# the baseline copies, each with the key of a run's ratio to it
RATIO_KEYS = {
    "copy-safetensors": "ratio_to_safetensors_copy",
    "copy-safetensors+fsync": "ratio_to_safetensors_copy_fsync",
    "copy-files": "ratio_to_file_copy",
    "copy-files+fsync": "ratio_to_file_copy_fsync",
}
COPIES = tuple(RATIO_KEYS)

SAMPLER = (
    """
import sys, threading, time
BENCH_DIR = """
    + repr(str(Path(__file__).resolve().parent))
    + """
PEAK = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
def _status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in PEAK:
            out[k] = int(v.split()[0]) * 1024
    return out
def _sample():
    while True:
        for k, v in _status().items():
            PEAK[k] = max(PEAK[k], v)
        time.sleep(0.02)
threading.Thread(target=_sample, daemon=True).start()
def prepare(src, cache):  # right before the timed part (after imports and the dry run): a cold cache
    sys.path.insert(0, BENCH_DIR)
    import convert as ct
    if cache != "cold":
        return {"cache": cache}
    how = ct.evict(src)
    return {"cache": cache, "evicted_by": how, "cached_before": ct.cached_fraction(src)}
def report(secs, **extra):
    for k, v in _status().items():
        PEAK[k] = max(PEAK[k], v)
    import json
    print("RESULT " + json.dumps({"seconds": secs, **{k.lower(): v for k, v in PEAK.items()}, **extra}))
"""
)

COPY = (
    SAMPLER
    + """
import shutil, sys, time
from pathlib import Path
src, out, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
out.mkdir(parents=True, exist_ok=True)
state = prepare(src, sys.argv[4])
if not kind.startswith("copy-files"):  # torch only where it is used: a file copy's peak memory stays its own
    from safetensors.torch import load_file, save_file
t0 = time.perf_counter()
for f in sorted(src.glob("*.safetensors")):
    if kind.startswith("copy-files"):
        shutil.copyfile(f, out / f.name)
    else:
        save_file(load_file(str(f)), str(out / f.name))
if kind.endswith("+fsync"):  # durable, as porter convert is before it writes its index
    import os
    for f in sorted(out.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
report(time.perf_counter() - t0, **state)
"""
)

CONVERT = (
    SAMPLER
    + """
import sys, time
from pathlib import Path
sys.path.insert(0, ROOT_PATH)
import porter
workers = None if sys.argv[3] == "all" else int(sys.argv[3])
dry = porter.convert(sys.argv[1], sys.argv[2], dry_run=True, workers=workers, device=sys.argv[4],
                     max_shard_size=sys.argv[6], digest=sys.argv[7])
state = prepare(Path(sys.argv[1]), sys.argv[5])
t0 = time.perf_counter()
done = porter.convert(sys.argv[1], sys.argv[2], progress=False, workers=workers, device=sys.argv[4],
                      max_shard_size=sys.argv[6], digest=sys.argv[7])
secs = time.perf_counter() - t0
import json
man = json.loads((Path(sys.argv[2]) / "porter.json").read_text())
report(secs, estimate=dry["peak_bytes_estimate"], fsync_seconds=done["fsync_seconds"],
       shard_digests={f: r["digest"] for f, r in man["shards"].items()}, **state)
"""
)


def child(code: str, *args) -> dict:
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"child failed ({res.returncode}): {res.stderr[-2000:]}")
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


def copy_run(src: Path, out: Path, kind: str, cache: str = "warm") -> dict:
    """One baseline copy in a fresh process: copy-safetensors, copy-files, either + fsync of every output."""
    return child(COPY, src, out, kind, cache)


def convert_run(
    src: Path,
    out: Path,
    workers: str = "all",
    device: str = "cpu",
    cache: str = "warm",
    max_shard_size: str = "512MB",
) -> dict:
    """One `porter convert` (porter's default digest) in a fresh process, after its dry run."""
    from porter.format.digest import DEFAULT_DIGEST  # here: a copy's child process imports this module too

    code = CONVERT.replace("ROOT_PATH", repr(str(ROOT)))
    return child(code, src, out, workers, device, cache, max_shard_size, DEFAULT_DIGEST)


# family -> (real-dims layers per GB of checkpoint at 8 experts, the dims in words)
FAMILIES = {
    "m3": (0.85, "H 6144, I 3072"),
    "m2-fp8": (5.7, "H 3072, I 1536, FP8 e4m3 + 128x128 block scales"),
    "m2-bf16": (3.0, "H 3072, I 1536, bf16"),
}


def bench_size(
    tmp: Path,
    target_gb: float,
    layers_per_gb: float,
    devices: list,
    repeats: int,
    single: bool,
    experts: int = 8,
    caches: tuple = ("warm",),
    max_shard_size: str = "512MB",
    copies: tuple = COPIES,
    family: str = "m3",
) -> dict:
    layers = max(2, round(target_gb * (layers_per_gb or FAMILIES[family][0])))
    t0 = time.time()
    src = build_checkpoint(tmp / f"src{target_gb}", layers, experts, family=family)
    build_s = time.time() - t0
    gb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
    print(f"# {gb:.2f} GB checkpoint ({layers} layers) built in {build_s:.0f} s", flush=True)
    runs = []
    configs = [(k, None, None) for k in copies]
    configs += [("convert", "all", d) for d in devices]
    if single:
        configs.append(("convert", "1", "cpu"))
    for cache in caches:
        if cache == "warm":
            warm(src)
        for r in range(repeats):
            for kind, workers, device in configs:
                if cache == "cold" and (
                    (kind, workers) == ("convert", "1") or kind == "copy-safetensors+fsync"
                ):
                    continue  # cold: the copies and the every-core conversions only
                out = tmp / f"out-{kind}-{workers}-{device}-{r}"
                if kind.startswith("copy"):
                    res = copy_run(src, out, kind, cache)
                else:
                    res = convert_run(src, out, workers, device, cache, max_shard_size)
                res |= {
                    "kind": kind,
                    "workers": workers,
                    "device": device,
                    "repeat": r,
                    "max_shard_size": max_shard_size if kind == "convert" else None,
                    "gb_per_s": gb / res["seconds"],
                }
                runs.append(res)
                shutil.rmtree(out, ignore_errors=True)
                os.sync()  # the next run starts with no dirty pages of this one still being written back
                print(json.dumps({k: v for k, v in res.items() if k != "shard_digests"}), flush=True)
    for x in runs:
        same = [y for y in runs if y["cache"] == x["cache"]]
        for kind, key in RATIO_KEYS.items():  # against the best run of each baseline in the same cache state
            x[key] = x["seconds"] / min(
                (y["seconds"] for y in same if y["kind"] == kind), default=float("nan")
            )
        if "estimate" in x:
            x["estimate_over_measured_peak"] = x["estimate"] / x["vmhwm"]
            x["projected_795gb_minutes"] = REAL_CHECKPOINT_GB / x["gb_per_s"] / 60
            x["gb_per_s_before_fsync"] = gb / (x["seconds"] - x["fsync_seconds"])
            same_layout = [y for y in runs if "shard_digests" in y]
            cpu = next((y for y in same_layout if y["device"] == "cpu"), None)
            x["same_bytes_as_cpu"] = None if cpu is None else x["shard_digests"] == cpu["shard_digests"]
            x["same_bytes_as_first_run"] = x["shard_digests"] == same_layout[0]["shard_digests"]
            x["output_shards"] = len(x["shard_digests"])
    shutil.rmtree(src, ignore_errors=True)
    return {
        "family": family,
        "source_gb": gb,
        "layers": layers,
        "experts_per_layer": experts,
        "build_seconds": build_s,
        "runs": runs,
    }


def summary_lines(result: dict) -> list:
    lines = [environment_line(result["machine"])]
    for s in result["sizes"]:
        lines.append(
            f"{s['source_gb']:.2f} GB ({s.get('family', 'm3')}: {s['layers']} layers at "
            f"{FAMILIES[s.get('family', 'm3')][1]}, {s['experts_per_layer']} experts):"
        )
        for x in s["runs"]:
            what = x["kind"] if x["kind"] != "convert" else f"convert {x['device']} workers={x['workers']}"
            if x.get("output_shards") is not None:
                what += f" {x['output_shards']}x{x['max_shard_size']}"
            what = f"{x['cache']:4s} {what}"
            extra = (
                (
                    f", fsync {x['fsync_seconds']:.2f} s ({x['gb_per_s_before_fsync']:.2f} GB/s before it), "
                    f"est/peak {x['estimate_over_measured_peak']:.2f}, same bytes as cpu {x['same_bytes_as_cpu']}"
                    f" / as first run of this layout {x['same_bytes_as_first_run']}, "
                    f"795 GB in {x['projected_795gb_minutes']:.1f} min"
                )
                if "estimate" in x
                else ""
            )
            if "cached_before" in x:
                extra += f", {100 * x['cached_before']:.0f}% cached at start ({x['evicted_by']})"
            lines.append(
                f"  {what:39s} {x['seconds']:7.2f} s {x['gb_per_s']:6.2f} GB/s "
                f"x{x['ratio_to_safetensors_copy']:.2f} of copy (x{x['ratio_to_safetensors_copy_fsync']:.2f} "
                f"of copy+fsync, x{x['ratio_to_file_copy']:.2f} of file copy, "
                f"x{x['ratio_to_file_copy_fsync']:.2f} of file copy+fsync); peak anon "
                f"{x['rssanon'] / 1e9:.2f} GB file {x['rssfile'] / 1e9:.2f} GB hwm {x['vmhwm'] / 1e9:.2f} GB"
                f"{extra}"
            )
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,8", help="checkpoint sizes in GB (approximate)")
    ap.add_argument(
        "--devices", default="cpu,cuda", help="convert devices to run (cuda skipped without a GPU)"
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cache", default="warm", help="page cache states to run: warm, cold or warm,cold")
    ap.add_argument("--no-single", action="store_true", help="skip the 1-worker (intra-op threads) CPU run")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    ap.add_argument(
        "--max-shard-size",
        default="512MB",
        help="porter convert --max-shard-size (output shards; "
        "512MB: many shards, as the release's conversion has, see above)",
    )
    ap.add_argument(
        "--copies",
        default=",".join(COPIES),
        help="baseline copies to run (comma list of " + ", ".join(COPIES) + "; empty: none)",
    )
    ap.add_argument(
        "--family", default="m3", choices=list(FAMILIES), help="checkpoint family and format (see above)"
    )
    ap.add_argument(
        "--layers-per-gb", type=float, default=None, help="real-dims layers per GB (default: the family's)"
    )
    ap.add_argument("--tmp", default=str(ROOT / "benchmarks"), help="where to build the checkpoints")
    ap.add_argument("--out", default=str(DEFAULT_OUT / "convert.json"))
    args = ap.parse_args()
    import torch

    devices = [d for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    result = {"machine": environment(), "date": time.strftime("%Y-%m-%d"), "sizes": []}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for size in (float(s) for s in args.sizes.split(",")):
            result["sizes"].append(
                bench_size(
                    Path(tmp),
                    size,
                    args.layers_per_gb,
                    devices,
                    args.repeats,
                    not args.no_single and size == float(args.sizes.split(",")[0]),
                    args.experts,
                    tuple(args.cache.split(",")),
                    args.max_shard_size,
                    tuple(c for c in args.copies.split(",") if c),
                    args.family,
                )
            )
    result["summary"] = summary_lines(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n".join(result["summary"]))


if __name__ == "__main__":
    main()
