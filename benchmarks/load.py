"""`runtime.load` and `porter verify` at MiniMax-M3's real layer dims (every layer full width, all 128 experts,
vocab 200064), warm and cold, against the floors of the disk and the bus measured in the same run.

Builds once in --workdir a vendor-layout checkpoint at the real dims with --layers layers (layer 0 dense, the
rest sparse attention + MoE; random bf16 weights) and converts it with porter's defaults. Then, in this one
process (CUDA initialized before any timing):

- floors: a 2 GiB page-locked (and a pageable) host buffer copied to the GPU; every shard read into
  page-locked buffers of the loader's size by the loader's thread count (and 8 threads), one large read per
  buffer, warm and cold — the rate a load cannot beat; xxh3-128 over page-locked buffers on those threads (the
  loader checks every tensor's digest);
- `safetensors safe_open + .to(cuda)`: every tensor memory-mapped and copied on its own, what runtime.load did
  before staging (no model built), warm;
- `runtime.load(ART, device="cuda")` warm (with rehash=True, every byte hashed, then of files a load here
  checked before, which are not hashed again; --hash-on-gpu: the digests computed on the GPU instead of the
  reading cores, runtime.loader.HASH_ON_GPU, and that kernel's own rate) and cold, and with two or more GPUs
  `device_map` over two;
- `porter verify ART --device cuda --numerics N` warm and cold (--verify-cache), against the time to read
  source + artifact once at the read floor of the same cache state; its pass layer-streamed and no tokens
  generated, as at the real size where nothing fits one GPU (--verify-streaming on; auto: verify's own
  choice for these few layers, resident, 16 tokens generated).

Each row: seconds, GB/s of the bytes it reads, its floor, the fraction of the floor, the peak host memory
above the run's start (RssAnon, sampled every 10 ms), and the projection at the real size (452 GB artifact,
795 GB source; runtime.load on 4 GPUs reads the same 452 GB through the same host, each GPU's link carrying
a quarter, so the projection is 452 GB at the measured one-GPU rate).

Cold: before each cold run `echo 3 > /proc/sys/vm/drop_caches` as root, else (or with --evict fadvise, on a
host shared with others) posix_fadvise(DONTNEED) on each shard (the table says which). Files in tmpfs
(/dev/shm) cannot be evicted: the summary says so, and its cold rows are warm ones. --device cpu: no GPU
floors or device_map rows, load and verify on the CPU; --dims H,I builds a smaller synthetic checkpoint (a
CPU-sized run) instead of the real dims.

    python benchmarks/load.py [--workdir /tmp/porter-load] [--layers 3] [--cache warm,cold]
                              [--verify both] [--verify-cache warm,cold] [--verify-streaming on|auto] [--out DIR]
                              [--device cuda|cpu] [--dims H,I] [--evict auto|fadvise] [--hash-on-gpu off|on|both]
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_OUT,
    REAL_VOCAB,
    build_checkpoint,
    cached_fraction,
    environment,
    environment_line,
    evict,
    markdown_table,
    warm,
    write_results,
)

REAL_ARTIFACT_GB, REAL_SOURCE_GB = 452.0, 795.0
GB = 1e9


class PeakRss:
    """Peak RssAnon above a run's start, sampled every 10 ms on a thread (page cache not counted)."""

    def __init__(self):
        self.base = self.peak = 0
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def now() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self):
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(0.01)

    def reset(self):
        self.base = self.peak = self.now()

    def above_start(self) -> int:
        return max(self.peak, self.now()) - self.base


MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}  # /dev/shm: no disk behind it, nothing to evict


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    for line in open("/proc/mounts"):
        _, mount, fstype = line.split()[:3]
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def shards(folder: Path) -> list:
    return sorted(folder.glob("*.safetensors"))


def nbytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in shards(folder))


def checked_before(art: Path) -> float:
    """Fraction of the artifact's tensor bytes this machine's record (porter/format/checked.py) says a load
    checked in files unchanged since: what runtime.load reads without hashing."""
    from runtime.loader import open_store

    store = open_store(art, record_checks=True)
    names = store.names() - store.carried_names()
    before = store.checked.snapshot({store.files[n] for n in names})
    trusted = sum(store.nbytes(n) for n in names if n in store.checked.trusted(store.files[n], before))
    store.close()
    return trusted / max(1, sum(store.nbytes(n) for n in names))


class PageCache:
    """Puts folders' shards into the page cache (warm: read once, unless nothing evicted them since) or out
    of it (cold: before every run, since every run reads them in)."""

    def __init__(self, drop_caches: bool = True):
        self.warm: set = set()
        self.drop_caches = drop_caches  # False: fadvise on these folders only (a host shared with others)

    def set(self, folders: list, cache: str) -> str:
        if cache == "warm":
            for f in folders:
                if f not in self.warm and cached_fraction(f) < 0.99:
                    warm(f)
                self.warm.add(f)
            return "read once"
        how = ",".join(sorted({evict(f, self.drop_caches) for f in folders}))
        self.warm = set() if how == "drop_caches" else self.warm - set(folders)
        return how


def read_floor(files: list, threads: int, buffer_bytes: int) -> float:
    """Seconds to read the files into page-locked buffers (one per thread, one large read per buffer)."""
    import torch

    items = [
        (f, at, min(buffer_bytes, f.stat().st_size - at))
        for f in files
        for at in range(0, f.stat().st_size, buffer_bytes)
    ]
    lock, nxt = threading.Lock(), [0]
    pin = torch.cuda.is_available()
    bufs = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(threads)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}

    def work(buf):
        view = memoryview(buf.numpy())
        while True:
            with lock:
                if nxt[0] == len(items):
                    return
                f, at, n = items[nxt[0]]
                nxt[0] += 1
            got = 0
            while got < n:
                got += os.preadv(fds[f], [view[got:n]], at + got)

    t0 = time.perf_counter()
    ws = [threading.Thread(target=work, args=(b,)) for b in bufs]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    secs = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return secs


def gpu_hash_seconds(dev, nb: int, nbytes: int = 2 << 30, chunk: int = 16 << 20) -> float:
    """Seconds for runtime/kernels/xxh3.py to digest `nbytes` on the GPU in chunks of `chunk` with `nb` blocks
    per step (one call, as the loader makes per tensor; the best of three after a warm-up)."""
    import torch

    from runtime.kernels import xxh3

    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    xxh3.chunk_digests(flat[: 1 << 20], chunk, nb)  # compile
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        xxh3.chunk_digests(flat, chunk, nb)
        best = min(best, time.perf_counter() - t0)
    return best


def hash_floor(total: int, threads: int, buffer_bytes: int) -> float:
    """Seconds for `threads` threads to xxh3-128 `total` bytes of page-locked buffers."""
    import torch
    import xxhash

    per = -(-total // threads)
    pin = torch.cuda.is_available()
    bufs = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin).fill_(7) for _ in range(threads)]

    def work(buf):
        view, done = memoryview(buf.numpy()), 0
        while done < per:
            n = min(buffer_bytes, per - done)
            h = xxhash.xxh3_128()
            h.update(view[:n])
            h.digest()
            done += n

    t0 = time.perf_counter()
    ws = [threading.Thread(target=work, args=(b,)) for b in bufs]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    return time.perf_counter() - t0


def h2d_rates(dev) -> dict:
    """GB/s of a 2 GiB host -> device copy, page-locked and pageable (median of 3)."""
    import torch

    out = {}
    dst = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    for kind, pin in (("pinned", True), ("pageable", False)):
        src = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=pin).fill_(1)
        times = []
        for _ in range(3):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        out[kind] = src.numel() / sorted(times)[1] / GB
    return out


def safetensors_to_cuda(art: Path) -> None:
    """What runtime.load did before staging: each tensor memory-mapped and copied to the GPU on its own."""
    import torch
    from safetensors import safe_open

    keep = []
    for f in shards(art):
        with safe_open(str(f), framework="pt") as h:
            keep += [h.get_tensor(n).to("cuda") for n in h.keys()]
    torch.cuda.synchronize()
    del keep


def free_gpu() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextmanager
def memory_limit(gb: Optional[float]):
    """This process in a fresh memory cgroup of `gb` GB while the block runs (None: as it is), then back in
    its own: what it allocates and the pages it reads meanwhile count against the limit."""
    if gb is None:
        yield
        return
    v1 = Path("/sys/fs/cgroup/memory")
    root = v1 if v1.is_dir() else Path("/sys/fs/cgroup")
    group = root / f"porter-bench-{os.getpid()}"
    group.mkdir()
    (group / ("memory.limit_in_bytes" if root == v1 else "memory.max")).write_text(str(int(gb * GB)))
    own = next(
        line.split(":", 2)[2].strip()
        for line in open("/proc/self/cgroup")
        if (root == v1 and ":memory:" in line) or (root != v1 and line.startswith("0::"))
    )
    procs = lambda g: g / "cgroup.procs"  # noqa: E731
    procs(group).write_text(str(os.getpid()))
    try:
        yield
    finally:
        procs(root / own.lstrip("/")).write_text(str(os.getpid()))
        group.rmdir()


def storage_reads() -> int:
    """Bytes this process caused to be read from storage so far (/proc/self/io read_bytes: page-cache hits
    and mapped pages already resident not counted), every thread."""
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def timed(fn, rss: PeakRss) -> tuple:
    free_gpu()
    rss.reset()
    t0 = time.perf_counter()
    out = fn()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, rss.above_start(), out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/porter-load", help="checkpoint and artifact (kept; on a disk)")
    ap.add_argument("--layers", type=int, default=3, help="decoder layers (layer 0 dense, the rest MoE)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--cache", default="warm,cold", help="page cache states of the load runs")
    ap.add_argument("--verify", default="both", help="porter verify --numerics (none: no verify run)")
    ap.add_argument("--verify-cache", default="warm,cold", help="page cache states of the verify runs")
    ap.add_argument(
        "--verify-memory-limit",
        type=float,
        default=None,
        help="GB: run verify in a memory cgroup of this size (root; cgroup v1 or v2), page cache included, as "
        "on a host that cannot hold the files (the real size): what it re-reads then comes from storage",
    )
    ap.add_argument(
        "--verify-streaming",
        default="on",
        choices=["on", "auto"],
        help="on: the teacher-forced pass layer-streamed, as at the real size (nothing fits one GPU); auto: "
        "verify's own choice (resident when the models fit, as these few layers do)",
    )
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for load.json and load.md")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (no GPU floors, no device_map rows)")
    ap.add_argument("--dims", default=None, help="H,I: synthetic hidden and expert widths (default: real)")
    ap.add_argument(
        "--hash-on-gpu",
        default="off",
        choices=["off", "on", "both"],
        help="warm loads with every digest computed on the GPU (runtime.loader.HASH_ON_GPU): on, or both beside "
        "the CPU's (the A/B that decides its default)",
    )
    ap.add_argument(
        "--evict", default="auto", choices=["auto", "fadvise"], help="auto: drop_caches as root, else fadvise"
    )
    args = ap.parse_args()
    stream_verify = True if args.verify_streaming == "on" else "auto"
    new_tokens = (
        0 if stream_verify is True else None
    )  # at the real size the converted model generates nothing
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(message)s"
    )  # the loader's breakdown
    import torch

    import porter
    import runtime
    from runtime import loader, staging

    work = Path(args.workdir)
    src, art = work / "src", work / "art"
    if not (src / "model.safetensors.index.json").exists():
        t = time.time()
        dims = tuple(int(x) for x in args.dims.split(",")) if args.dims else None
        build_checkpoint(src, args.layers, args.experts, None if dims else REAL_VOCAB, dims=dims)
        print(f"# built {nbytes(src) / GB:.1f} GB checkpoint in {time.time() - t:.0f} s", flush=True)
    if not (art / "model.safetensors.index.json").exists():
        t = time.time()
        porter.convert(src, art, progress=False)
        print(f"# converted to {nbytes(art) / GB:.1f} GB in {time.time() - t:.0f} s", flush=True)
    os.sync()
    env = environment()
    fs = filesystem(work)
    if fs in MEMORY_FILESYSTEMS and "cold" in f"{args.cache},{args.verify_cache}":
        print(f"# {work} is on {fs}: its pages cannot be evicted, every 'cold' row is a warm one", flush=True)
    art_b, src_b = nbytes(art), nbytes(src)
    threads, buf = staging.default_threads(), staging.BUFFER_BYTES
    cuda = args.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    if cuda:
        torch.cuda.init()
        torch.empty(1, device="cuda")
    rss = PeakRss()
    doc = {
        "machine": env,
        "workdir": str(work),
        "filesystem": fs,
        "layers": args.layers,
        "dims": args.dims or "real",
        "device": args.device,
        "experts": args.experts,
        "verify_streaming": args.verify_streaming,
        "verify_memory_limit_gb": args.verify_memory_limit,
        "artifact_bytes": art_b,
        "source_bytes": src_b,
        "threads": threads,
        "buffer_bytes": buf,
        "runs": [],
    }

    def add(what, cache, how, secs, nbytes_, floor_gbs=None, peak=None, extra=None):
        gbs = nbytes_ / secs / GB
        r = {
            "what": what,
            "cache": cache,
            "cache_by": how,
            "seconds": secs,
            "bytes": nbytes_,
            "gb_per_s": gbs,
            "floor_gb_per_s": floor_gbs,
            "of_floor": gbs / floor_gbs if floor_gbs else None,
            "peak_host_anon_bytes": peak,
            **(extra or {}),
        }
        doc["runs"].append(r)
        print(
            f"{what:48s} {cache:4s} {secs:7.2f} s {gbs:6.2f} GB/s"
            + (f" ({100 * r['of_floor']:.0f}% of {floor_gbs:.1f})" if floor_gbs else "")
            + (f" peak anon +{peak / GB:.2f} GB" if peak is not None else ""),
            flush=True,
        )
        return r

    if cuda:
        h2d = h2d_rates(torch.device("cuda", 0))
        add("floor: pinned H2D copy (2 GiB)", "-", "-", 2 * (1 << 30) / GB / h2d["pinned"], 2 << 30)
        add("floor: pageable H2D copy (2 GiB)", "-", "-", 2 * (1 << 30) / GB / h2d["pageable"], 2 << 30)
    add(f"floor: xxh3-128, {threads} threads", "-", "-", hash_floor(art_b, threads, buf), art_b)
    if cuda and args.hash_on_gpu != "off":
        for nb in (4, 8, 16, 32):  # the kernel's blocks per step (runtime/kernels/xxh3.py BLOCKS_PER_STEP)
            secs = gpu_hash_seconds(torch.device("cuda", 0), nb)
            add(f"xxh3-128 on the GPU (2 GiB, 16 MiB chunks), {nb} blocks per step", "-", "-", secs, 2 << 30)
    floor, pc = {}, PageCache(args.evict == "auto")
    folders = [("artifact", art, art_b)] + ([("source", src, src_b)] if args.verify != "none" else [])
    caches = set(args.cache.split(",")) | (
        set(args.verify_cache.split(",")) if args.verify != "none" else set()
    )
    for cache in [c for c in ("warm", "cold") if c in caches]:
        for name, folder, b in folders:
            for n in sorted({threads, 8} if cache == "warm" else {threads}, reverse=True):
                how = pc.set([folder], cache)
                secs = read_floor(shards(folder), n, buf)
                r = add(f"floor: read {name} into pinned, {n} threads", cache, how, secs, b)
                if n == threads:
                    floor[(name, cache)] = r["gb_per_s"]
        if cache in args.cache.split(","):  # the load rows (the verify rows have their own cache states)
            if cache == "warm" and cuda:
                how = pc.set([art], cache)
                s, peak, _ = timed(lambda: safetensors_to_cuda(art), rss)
                add(
                    "safetensors safe_open + .to(cuda) (before)",
                    cache,
                    how,
                    s,
                    art_b,
                    floor[("artifact", cache)],
                    peak,
                )
            # rehash: every byte hashed, as on a machine that has not checked these files; checked before:
            # the files unchanged since a load here checked them (porter/format/checked.py), none hashed
            runs = [("first in the process", True), ("again", True), ("", False)]
            if cuda and args.hash_on_gpu in ("on", "both"):  # the A/B of runtime.loader.HASH_ON_GPU
                gpu_runs = [("digests on the GPU", True), ("digests on the GPU, again", True)]
                runs = gpu_runs + ([] if args.hash_on_gpu == "on" else runs)
            for what, rehash in runs if cache == "warm" else [("", False)]:
                loader.HASH_ON_GPU = "on the GPU" in what
                how = pc.set([art], cache)
                cached, trusted = cached_fraction(art), 0.0 if rehash else checked_before(art)
                s, peak, model = timed(lambda: runtime.load(art, device=args.device, rehash=rehash), rss)
                del model
                call = f"runtime.load(device='{args.device}'" + (", rehash=True)" if rehash else ")")
                label = call + (f" {what}" if rehash else f", {100 * trusted:.0f}% checked before")
                r = add(
                    label,
                    cache,
                    how,
                    s,
                    art_b,
                    floor[("artifact", cache)],
                    peak,
                    {"cached_at_start": cached, "checked_before": trusted},
                )
                r["projected_real_seconds"] = REAL_ARTIFACT_GB / r["gb_per_s"]
            loader.HASH_ON_GPU = False
            if gpus >= 2:
                how = pc.set([art], cache)
                split = {f"layers.{i}": f"cuda:{int(i >= args.layers // 2)}" for i in range(args.layers)}
                two = lambda: runtime.load(art, device_map=split, max_memory={0: "120GiB", 1: "120GiB"})  # noqa: E731
                s, peak, model = timed(two, rss)
                del model
                add(
                    "runtime.load(device_map over 2 GPUs)",
                    cache,
                    how,
                    s,
                    art_b,
                    floor[("artifact", cache)],
                    peak,
                )
        if args.verify == "none" or cache not in args.verify_cache.split(","):
            continue
        how = pc.set([src, art], cache)
        cached = cached_fraction(art) if cache == "cold" else None
        disk = storage_reads()
        with memory_limit(args.verify_memory_limit):
            s, peak, res = timed(
                lambda: porter.verify(
                    art,
                    device=args.device,
                    numerics=args.verify,
                    streaming=stream_verify,
                    max_new_tokens=new_tokens,
                ),
                rss,
            )
        read_once = art_b / GB / floor[("artifact", cache)] + src_b / GB / floor[("source", cache)]
        both = (src_b + art_b) / GB
        r = add(
            f"porter verify --numerics {args.verify}" + (" --stream" if stream_verify is True else ""),
            cache,
            how,
            s,
            src_b + art_b,
            both / read_once,
            peak,
            {"passed": res.passed, "read_once_seconds": read_once, "cached_at_start": cached},
        )
        r["disk_read_bytes"] = storage_reads() - disk  # what the page cache did not serve
        print(
            f"    read from storage: {r['disk_read_bytes'] / GB:.2f} GB, "
            f"{r['disk_read_bytes'] / (src_b + art_b):.2f}x source + artifact",
            flush=True,
        )
        r["over_read_once"] = s / read_once
        r["phases"] = res.report.phases  # verify's split: integrity, exact, generation, numerics.load/pass
        print("    verify phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases"].items()), flush=True)
        real_read_once = (REAL_SOURCE_GB + REAL_ARTIFACT_GB) / (both / read_once)
        r["projected_real_seconds"] = r["over_read_once"] * real_read_once

    doc["summary"] = summary(doc, env)
    write_results(args.out, "load", doc, doc["summary"])


def summary(doc: dict, env: dict) -> list:
    vocab = REAL_VOCAB if doc["dims"] == "real" else "of the fixture"
    lines = [
        f"# runtime.load and porter verify at {doc['dims']} dims — {env.get('gpu') or 'CPU'}",
        "",
        environment_line(env) + ".",
        "",
        f"{doc['layers']} layers (layer 0 dense, the rest MoE with {doc['experts']} experts), vocab {vocab}: "
        f"artifact {doc['artifact_bytes'] / GB:.1f} GB, source {doc['source_bytes'] / GB:.1f} GB; loader "
        f"{doc['threads']} threads x {doc['buffer_bytes'] >> 20} MiB staging buffers; files on "
        f"{doc['filesystem']} ({doc['workdir']})"
        + (
            ": cold rows are warm (memory cannot be evicted)"
            if doc["filesystem"] in MEMORY_FILESYSTEMS
            else ""
        )
        + ".",
        "",
    ]
    rows = []
    for r in doc["runs"]:
        proj = r.get("projected_real_seconds")
        rows.append(
            [
                r["what"],
                r["cache"] + (f" ({r['cache_by']})" if r["cache"] == "cold" else ""),
                f"{r['seconds']:.2f}",
                f"{r['gb_per_s']:.2f}",
                f"{r['floor_gb_per_s']:.2f}" if r["floor_gb_per_s"] else "",
                f"{100 * r['of_floor']:.0f}%" if r["of_floor"] else "",
                f"{r['peak_host_anon_bytes'] / GB:.2f}" if r["peak_host_anon_bytes"] is not None else "",
                f"{proj / 60:.1f} min" if proj else "",
            ]
        )
    lines += markdown_table(
        ["run", "cache", "s", "GB/s", "floor GB/s", "of floor", "host anon GB", "real size"], rows
    )
    for r in doc["runs"]:
        if r.get("phases"):
            split = ", ".join(f"{k} {v:.2f} s" for k, v in r["phases"].items())
            lines += [
                "",
                f"{r['what']} ({r['cache']}): {r['over_read_once']:.2f}x the time of reading both once, "
                f"{r['disk_read_bytes'] / r['bytes']:.2f}x their bytes read from storage; {split}.",
            ]
    return lines


if __name__ == "__main__":
    main()
