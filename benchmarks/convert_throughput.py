"""Conversion throughput and memory at MiniMax-M3's real layer dims, CPU and GPU, against a plain copy.

For each checkpoint size (synthetic vendor-layout MiniMax-M3 with H 6144, I 3072, 64 q / 4 kv heads of
128, indexer 4x128, 8 experts per layer instead of 128; random bf16 weights), within one run, from a warm
page cache and (--cache cold) from disk:

- baseline: safetensors `load_file` + `save_file` of every shard (what any converter pays to read and
  write the bytes), the same plus fsync of every output (porter syncs its shards before writing the
  index), and a raw file copy (`shutil.copyfile`, the I/O floor), also plus fsync of every output (the
  durable I/O floor: from disk a copy that is not synced ends with most of its output still in the page
  cache, while porter's time includes writing all of it);
- `porter convert` on the CPU (`--workers` = every core, and 1 worker with torch's intra-op threads: what
  scales) and with `--device cuda` when there is a GPU;
- for each: seconds, GB/s of source consumed, ratio to the same cache state's safetensors copy, peak
  memory split into anonymous and file-backed (RssAnon / RssFile sampled from /proc/self/status every
  20 ms; VmHWM too), `--dry-run`'s memory estimate against the measured peak, the seconds of the final
  fsync inside the conversion, whether the output is byte-identical to the CPU conversion (same shard
  digests), and the projected time for the real 795 GB checkpoint at the measured rate.

Output shards: 512MB by default (--max-shard-size), not porter's 5GB. The release's ~430 GB of output is ~86
shards of 5 GB, so a conversion of it always has its SHARDS_IN_FLIGHT shards open; an 8 GB synthetic checkpoint
at 5 GB shards has 2 (nearly every byte in the first) and would measure a one-file regime the real run never
sees. At 512MB the 8 GB checkpoint writes 13 shards (stacked expert tensors of 151-302 MB: 1-3 per shard; the
release's 2.4-4.8 GB stacked tensors: 1-2 per 5 GB shard). Measured on the H200 machine, 16
cores, --device cuda: 2.88-2.92 s at 512MB vs 3.00-3.25 s at 5GB (benchmarks/results/convert_round6.md).

Between runs the last run's output is deleted and os.sync() returns only once its writeback is done, so no run
pays for the one before it (before round 15 a conversion on 2 cores ran right after a copy's 1.9 GB of dirty
pages and measured ~0.2 s slower than the same conversion alone).

Cold: before each run the page cache is emptied (`echo 3 > /proc/sys/vm/drop_caches` as root; otherwise the
source files' clean pages are evicted with posix_fadvise(DONTNEED), which leaves other files cached).

    python benchmarks/convert_throughput.py [--sizes 2,8] [--devices cpu,cuda] [--cache warm,cold]
                                            [--repeats 1] [--out FILE]

Goals (docs: README "Speed"): convert <= 1.5x the safetensors copy on 16 and on 2 cores; >= 5 GB/s from
page cache with --device cuda on an H200 machine, and within 1.2x of a plain copy from disk.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

REAL_CHECKPOINT_GB = 795.0  # MiniMax-M3 BF16 release, safetensors bytes
# the baseline copies, each with the key of a run's ratio to it
RATIO_KEYS = {"copy-safetensors": "ratio_to_safetensors_copy", "copy-safetensors+fsync": "ratio_to_safetensors_copy_fsync",
              "copy-files": "ratio_to_file_copy", "copy-files+fsync": "ratio_to_file_copy_fsync"}
COPIES = tuple(RATIO_KEYS)

SAMPLER = """
import sys, threading, time
BENCH_DIR = """ + repr(str(Path(__file__).resolve().parent)) + """
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
    import convert_throughput as ct
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

COPY = SAMPLER + """
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

CONVERT = SAMPLER + """
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


def child(code: str, *args, env=None) -> dict:
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env)
    if res.returncode:
        raise RuntimeError(f"child failed ({res.returncode}): {res.stderr[-2000:]}")
    return json.loads([line for line in res.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])


def copy_run(src: Path, out: Path, kind: str, cache: str = "warm") -> dict:
    """One baseline copy in a fresh process: copy-safetensors, copy-files, either + fsync of every output."""
    return child(COPY, src, out, kind, cache)


def convert_run(src: Path, out: Path, workers: str = "all", device: str = "cpu", cache: str = "warm",
                max_shard_size: str = "512MB", root: Path = ROOT, env=None, digest: str = None) -> dict:
    """One `porter convert` (of the porter tree at `root`) in a fresh process, after its dry run; digest:
    convert's --digest (None: porter's default)."""
    from porter.format.digest import DEFAULT_DIGEST  # here: a copy's child process imports this module too
    digest = digest or DEFAULT_DIGEST
    return child(CONVERT.replace("ROOT_PATH", repr(str(root))), src, out, workers, device, cache, max_shard_size,
                 digest, env=env)


class _PooledRandn:
    """Stands in for `torch` inside tiny_checkpoint while building: randn returns windows of one shared
    random pool, so an 8 GB checkpoint builds in seconds, not minutes (values stay N(0, 1); conversion
    cost does not depend on them)."""

    def __init__(self, torch_module, elems: int = 96 << 20):
        self._torch = torch_module
        self._pool = torch_module.randn(elems)
        self._at = 0

    def randn(self, *shape, generator=None):
        n = 1
        for d in shape:
            n *= d
        if n > self._pool.numel():
            return self._torch.randn(*shape)
        self._at = (self._at + 7_919_113) % (self._pool.numel() - n + 1)
        return self._pool[self._at:self._at + n].view(*shape)

    def __getattr__(self, name):
        return getattr(self._torch, name)


def build_checkpoint(out: Path, layers: int, experts: int) -> Path:
    import tiny_checkpoint
    real = tiny_checkpoint.torch
    tiny_checkpoint.torch = _PooledRandn(real)
    try:
        overrides = tiny_checkpoint.real_dims_overrides(layers, experts)
        return tiny_checkpoint.build_tiny_checkpoint(out, text_overrides=overrides, max_shard_tensors=40)
    finally:
        tiny_checkpoint.torch = real


def evict(path: Path) -> str:
    """Empty the page cache for a cold run; returns how (drop_caches as root, else fadvise on the sources)."""
    os.sync()
    if os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for f in sorted(path.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def cached_fraction(path: Path) -> float:
    """Fraction of the source files' pages in the page cache now (mincore), to show a cold run was cold."""
    import ctypes
    import mmap
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    have = total = 0
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY) as m:
            n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * n)()
            anchor = ctypes.c_char.from_buffer(m)  # the mapping's address (private: nothing is written)
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
            del anchor
            if rc:
                raise OSError(ctypes.get_errno(), f"mincore {f}")
            have += n - bytes(vec).count(0)
            total += n
    return have / total if total else 1.0


def warm(path: Path) -> None:
    """Read the shards once so every run starts from the same warm page cache."""
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def machine() -> dict:
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "mem_total_gb": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9}


def bench_size(tmp: Path, target_gb: float, layers_per_gb: float, devices: list, repeats: int, single: bool,
               experts: int = 8, caches: tuple = ("warm",), max_shard_size: str = "512MB",
               variants: tuple = ((None, {}),), floor: bool = False,
               copies: tuple = COPIES) -> dict:
    layers = max(2, round(target_gb * layers_per_gb))
    t0 = time.time()
    src = build_checkpoint(tmp / f"src{target_gb}", layers, experts)
    build_s = time.time() - t0
    gb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
    print(f"# {gb:.2f} GB checkpoint ({layers} layers) built in {build_s:.0f} s", flush=True)
    runs = []
    floor_result = None
    if floor:  # the bytes floor (benchmarks/convert_floor.py) of this checkpoint, first, in its own process
        warm(src)
        res = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "convert_floor.py"), "--src",
                              str(src), "--max-shard-size", max_shard_size, "--tmp", str(tmp),
                              "--out", str(tmp / "floor.json")] + (["--gpu"] if "cuda" in devices else []),
                             capture_output=True, text=True)
        print(res.stdout, end="", flush=True)
        if res.returncode:
            print(f"# floor failed: {res.stderr[-1500:]}", flush=True)
        else:
            floor_result = json.loads((tmp / "floor.json").read_text())
    configs = [(k, None, None) for k in copies]
    configs += [("convert", "all", d) for d in devices]
    if single:
        configs.append(("convert", "1", "cpu"))
    # environment variants (label, {PORTER_*: value}) for the conversions: (None, {}) is porter's defaults
    # (a label ending in @cpu or @cuda runs on that device only)
    configs = [(k, w, d, v) for k, w, d in configs for v in (variants if k == "convert" else ((None, {}),))
               if not (v[0] and "@" in v[0] and v[0].rsplit("@", 1)[1] != d)]
    for cache in caches:
        if cache == "warm":
            warm(src)
        for r in range(repeats):
            for kind, workers, device, (label, extra_env) in configs:
                if cache == "cold" and ((kind, workers) == ("convert", "1") or kind == "copy-safetensors+fsync"):
                    continue  # cold: the copies and the every-core conversions only
                out = tmp / f"out-{kind}-{workers}-{device}-{label}-{r}"
                extra_env = dict(extra_env)
                shard_size = extra_env.pop("SHARD", max_shard_size)  # pseudo-variables: convert's arguments
                workers = extra_env.pop("WORKERS", workers)
                digest = extra_env.pop("DIGEST", None)  # convert's --digest (None: porter's default)
                if kind.startswith("copy"):
                    res = copy_run(src, out, kind, cache)
                else:
                    env = dict(os.environ, **extra_env) if extra_env else None
                    res = convert_run(src, out, workers, device, cache, shard_size, env=env, digest=digest)
                    res["digest"] = digest
                res |= {"kind": kind, "workers": workers, "device": device, "repeat": r, "variant": label,
                        "variant_env": extra_env,
                        "max_shard_size": shard_size if kind == "convert" else None,
                        "gb_per_s": gb / res["seconds"]}
                runs.append(res)
                shutil.rmtree(out, ignore_errors=True)
                os.sync()  # the next run starts with no dirty pages of this one still being written back
                print(json.dumps({k: v for k, v in res.items() if k != "shard_digests"}), flush=True)
    for x in runs:
        same = [y for y in runs if y["cache"] == x["cache"]]
        for kind, key in RATIO_KEYS.items():  # against the best run of each baseline in the same cache state
            x[key] = x["seconds"] / min((y["seconds"] for y in same if y["kind"] == kind), default=float("nan"))
        if "estimate" in x:
            x["estimate_over_measured_peak"] = x["estimate"] / x["vmhwm"]
            x["projected_795gb_minutes"] = REAL_CHECKPOINT_GB / x["gb_per_s"] / 60
            x["gb_per_s_before_fsync"] = gb / (x["seconds"] - x["fsync_seconds"])
            same_layout = [y for y in runs if "shard_digests" in y and y["max_shard_size"] == x["max_shard_size"]
                           and y["digest"] == x["digest"]]  # digests of one rule compare bytes
            cpu = next((y for y in same_layout if y["device"] == "cpu" and not y["variant"]),
                       next((y for y in same_layout if y["device"] == "cpu"), None))
            x["same_bytes_as_cpu"] = None if cpu is None else x["shard_digests"] == cpu["shard_digests"]
            x["same_bytes_as_first_run"] = x["shard_digests"] == same_layout[0]["shard_digests"]
            x["output_shards"] = len(x["shard_digests"])
    shutil.rmtree(src, ignore_errors=True)
    return {"source_gb": gb, "layers": layers, "experts_per_layer": experts, "build_seconds": build_s, "runs": runs,
            "floor": floor_result}


def summary_lines(result: dict) -> list:
    m = result["machine"]
    lines = [f"{m['cpu']}, {m['cores']} cores, GPU {m['gpu']}, torch {m['torch']}"]
    for s in result["sizes"]:
        lines.append(f"{s['source_gb']:.2f} GB ({s['layers']} layers at H 6144, I 3072, "
                     f"{s['experts_per_layer']} experts):")
        for x in s["runs"]:
            what = x["kind"] if x["kind"] != "convert" else f"convert {x['device']} workers={x['workers']}"
            if x.get("output_shards") is not None:
                what += f" {x['output_shards']}x{x['max_shard_size']}"
            if x.get("variant"):
                what += f" [{x['variant']}]"
            what = f"{x['cache']:4s} {what}"
            extra = (f", fsync {x['fsync_seconds']:.2f} s ({x['gb_per_s_before_fsync']:.2f} GB/s before it), "
                     f"est/peak {x['estimate_over_measured_peak']:.2f}, same bytes as cpu {x['same_bytes_as_cpu']}"
                     f" / as first run of this layout {x['same_bytes_as_first_run']}, "
                     f"795 GB in {x['projected_795gb_minutes']:.1f} min") if "estimate" in x else ""
            if "cached_before" in x:
                extra += f", {100 * x['cached_before']:.0f}% cached at start ({x['evicted_by']})"
            lines.append(f"  {what:39s} {x['seconds']:7.2f} s {x['gb_per_s']:6.2f} GB/s "
                         f"x{x['ratio_to_safetensors_copy']:.2f} of copy (x{x['ratio_to_safetensors_copy_fsync']:.2f} "
                         f"of copy+fsync, x{x['ratio_to_file_copy']:.2f} of file copy, "
                         f"x{x['ratio_to_file_copy_fsync']:.2f} of file copy+fsync); peak anon "
                         f"{x['rssanon'] / 1e9:.2f} GB file {x['rssfile'] / 1e9:.2f} GB hwm {x['vmhwm'] / 1e9:.2f} GB"
                         f"{extra}")
        fl = s.get("floor")
        if fl:
            lines.append(f"  bytes floor ({fl['threads']} threads, {fl['output_shards']} output shards, "
                         f"{fl['output_gb']:.2f} GB out):")
            for name, r in fl["runs"].items():
                line = f"    {name:34s} {r['seconds']:6.2f} s {r['gb'] / r['seconds']:6.2f} GB/s"
                if "fsync_seconds" in r:
                    line += f"; + fsync {r['fsync_seconds']:.2f} s: {r['gb'] / (r['seconds'] + r['fsync_seconds']):.2f} GB/s"
                if name.startswith("copy"):
                    line += (f" (source {fl['source_gb'] / r['seconds']:.2f} GB/s, + fsync "
                             f"{fl['source_gb'] / (r['seconds'] + r['fsync_seconds']):.2f})")
                lines.append(line)
            for name, r in (fl.get("gpu") or {}).items():
                if not isinstance(r, dict):
                    continue
                lines.append(f"    gpu {name:30s} {r['gb'] / r['seconds']:7.2f} GB/s of bf16 expert parts")
    return lines


def parse_variants(text: str, with_default: bool = True) -> tuple:
    """'label:NAME=V,NAME=V;label2:NAME=V' -> ((None, {}), (label, {NAME: V, ...}), ...)."""
    out = [(None, {})] if with_default or not text.strip() else []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        label, _, pairs = item.partition(":")
        out.append((label, dict(p.split("=", 1) for p in pairs.split(",") if p)))
    return tuple(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,8", help="checkpoint sizes in GB (approximate)")
    ap.add_argument("--devices", default="cpu,cuda", help="convert devices to run (cuda skipped without a GPU)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cache", default="warm", help="page cache states to run: warm, cold or warm,cold")
    ap.add_argument("--no-single", action="store_true", help="skip the 1-worker (intra-op threads) CPU run")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    ap.add_argument("--max-shard-size", default="512MB", help="porter convert --max-shard-size (output shards; "
                    "512MB: many shards, as the release's conversion has, see above); "
                    "a variant's SHARD=SIZE overrides it for that variant (WORKERS=N the worker count, DIGEST=sha256 "
                    "convert's --digest)")
    ap.add_argument("--copies", default=",".join(COPIES), help="baseline copies to run (comma list of "
                    + ", ".join(COPIES) + "; empty: none)")
    ap.add_argument("--variants", default="", help="conversion environment variants to A/B besides porter's "
                    "defaults: 'label:NAME=V,NAME=V;label2:NAME=V' (e.g. inline:PORTER_WRITEBACK=inline)")
    ap.add_argument("--floor", action="store_true", help="also measure the bytes floor (convert_floor.py)")
    ap.add_argument("--no-default", action="store_true", help="with --variants: skip the defaults' conversions")
    ap.add_argument("--layers-per-gb", type=float, default=0.85, help="real-dims layers per GB of checkpoint")
    ap.add_argument("--tmp", default=str(ROOT / "benchmarks"), help="where to build the checkpoints")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "convert_throughput.json"))
    args = ap.parse_args()
    import torch
    devices = [d for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "sizes": []}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for size in (float(s) for s in args.sizes.split(",")):
            result["sizes"].append(bench_size(Path(tmp), size, args.layers_per_gb, devices, args.repeats,
                                              not args.no_single and size == float(args.sizes.split(",")[0]),
                                              args.experts, tuple(args.cache.split(",")), args.max_shard_size,
                                              parse_variants(args.variants, not args.no_default), args.floor,
                                              tuple(c for c in args.copies.split(",") if c)))
    result["summary"] = summary_lines(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n".join(result["summary"]))


if __name__ == "__main__":
    main()
