"""The bytes floor of a conversion on this machine: how fast N threads move its bytes with no work in between.

For a checkpoint folder and the output layout `porter convert` would write for it (shard files and sizes from
its dry run), each measured in a fresh set of files, threads taking 16 MiB pieces in order:

- read: pread every source byte (from the page cache when warm);
- write: pwrite the output's bytes into the conversion's shard files (several threads into one shard, as a
  conversion does), then fsync them all (durable, as porter is before it writes its index); --many-files:
  pwrite into one file per thread (no shared inode lock), what writing many threads into one shard costs;
- copy: read the source and write the output's bytes (pieces in proportion), page cache only and + fsync:
  the floor `porter convert` is held to ("x plain copy" uses it); also with each piece's writeback started
  right after it (sync_file_range: porter's inline writeback, with --inline) or by one background thread
  (porter.pipeline.Writeback: porter's default), the latter also with the pieces taken round-robin over
  --in-flight shards at a time (porter.pipeline.interleave_shards, as a conversion takes its units; default
  porter's shards_in_flight for --threads workers), so several inodes are written at once;
- --gpu: what the GPU path's device side moves on its own, one thread and N threads with a stream each: host
  -> device copies of an expert part ([3072, 6144] bf16, 37.7 MB) from page-locked memory, device -> host
  copies of its results, porter.format.mxfp8.quantize_with_error on the device, and all three per part (the
  GPU path of a conversion without its disk I/O and hashing); "host" only pwrites a part's 18.9 MB of values
  into a file per thread (over the same bytes each time: page cache) and hashes them (porter's default chunk hash), a worker's host
  work per part, and "all+host" does both: if it takes much longer than the slower of "all" and "host", the
  workers' host and GPU work serialize (the GIL, or CUDA's host-side locks).

Prints GB/s of the bytes each moves and, for copy, GB/s of source consumed (the unit porter convert's rate is
in). JSON to --out.

    python benchmarks/convert_floor.py --src DIR [--threads 16] [--max-shard-size 5GB] [--gpu] [--many-files]
                                       [--in-flight N] [--inline] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PIECE = 16 << 20


def run_threads(n: int, jobs: list, fn) -> float:
    """Seconds for n threads to run fn(job) over jobs, taken in order."""
    lock, todo = threading.Lock(), list(reversed(jobs))

    def work():
        while True:
            with lock:
                if not todo:
                    return
                job = todo.pop()
            fn(job)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pieces(sizes: list) -> list:
    """(file index, offset, length) of every PIECE of files of these sizes, file after file."""
    return [(i, o, min(PIECE, s - o)) for i, s in enumerate(sizes) for o in range(0, s, PIECE)]


def open_outputs(folder: Path, sizes: list) -> list:
    folder.mkdir(parents=True, exist_ok=True)
    fds = []
    for i, s in enumerate(sizes):
        fd = os.open(folder / f"out-{i}.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, s)
        fds.append(fd)
    return fds


def gpu_floor(threads: int, parts: int = 8, tmp: str = str(ROOT / "benchmarks")) -> dict:
    """GB/s (of source bf16 bytes) of the GPU path's device side, 1 thread and `threads` threads. Every thread
    of a round takes its own buffers and stream, all made (and their pages locked) before any round; each
    timed round follows an untimed one."""
    import itertools
    import torch
    from porter.format import mxfp8
    from porter.pipeline import prefault
    dev = torch.device("cuda")
    torch.empty(1, device=dev)
    shape = (3072, 6144)
    codes = []

    def make():
        host = torch.empty(shape, dtype=torch.bfloat16)
        out = torch.empty(shape[0] * shape[1] * 33 // 32, dtype=torch.uint8)
        for t in (host, out):
            prefault(t)
            codes.append(int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)))
        host.copy_(torch.randn(shape))
        return host, out, torch.cuda.Stream(dev), host.to(dev)
    slots = [make() for _ in range(threads)]

    import tempfile
    from porter.format.digest import CHUNK_HASHES, DEFAULT_DIGEST
    from porter.format.safetensors_io import pwrite_all
    chunk_hash = CHUNK_HASHES[DEFAULT_DIGEST]
    spill = tempfile.TemporaryDirectory(dir=tmp)
    q_bytes = shape[0] * shape[1]
    spill_fds = []

    def run(kind: str, n: int) -> float:
        local, counter = threading.local(), itertools.count()

        def step(_):
            if not hasattr(local, "slot"):
                local.slot = slots[next(counter)]
            host, out, stream, on_dev = local.slot
            if kind != "host":
                gpu_step(kind, host, out, stream, on_dev)
            if kind in ("host", "all+host", "all+host fused"):
                if not hasattr(local, "fd"):
                    local.fd = os.open(Path(spill.name) / f"t{threading.get_ident()}", os.O_RDWR | os.O_CREAT, 0o644)
                    spill_fds.append(local.fd)
                values = memoryview(out.numpy())[:q_bytes]
                pwrite_all(local.fd, values, 0)
                chunk_hash(values).digest()
        return run_threads(n, [kind] * (parts * n), step)

    from porter.format import mxfp8_triton

    def gpu_step(kind, host, out, stream, on_dev):
        fused = kind.endswith(" fused")  # mxfp8_triton (PORTER_CUDA_QUANTIZE=fused) instead of torch ops
        kind = kind.removesuffix(" fused")
        with torch.cuda.stream(stream):
            x = host.to(dev, non_blocking=True) if kind in ("h2d", "all", "all+host") else on_dev
            if kind in ("quantize", "all", "all+host") and fused:
                q, sc, stats = mxfp8_triton.quantize_with_error(x, "rceil", "part")
            elif kind in ("quantize", "all", "all+host"):
                q, sc, err = mxfp8.quantize_with_error(x, "rceil", "part", host_stats=False)
            else:  # the size of a part's values (e4m3: one byte per element)
                q = x.view(torch.uint8).view(-1)[:shape[0] * shape[1]]
            if kind in ("d2h", "all", "all+host"):
                out[:q.numel()].copy_(q.reshape(-1).view(torch.uint8), non_blocking=True)
            stream.synchronize()
    res = {"registered": all(c == 0 for c in codes)}
    part_gb = shape[0] * shape[1] * 2 / 1e9
    print(f"gpu buffers page-locked: {res['registered']}", flush=True)
    for kind in ("h2d", "d2h", "quantize", "quantize fused", "all", "all fused", "host", "all+host",
                 "all+host fused"):
        for n in (1, threads):
            run(kind, n)  # untimed: kernels loaded, the caching allocator filled
            secs = run(kind, n)
            res[f"{kind}, {n} threads"] = {"seconds": secs, "gb": part_gb * parts * n}
            print(f"gpu {kind:14s} {n:2d} threads {part_gb * parts * n / secs:7.2f} GB/s of bf16 parts", flush=True)
    for fd in spill_fds:
        os.close(fd)
    spill.cleanup()
    return res


def fsync_all(fds: list, threads: int) -> float:
    return run_threads(min(threads, len(fds)), fds, os.fsync)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--tmp", default=str(ROOT / "benchmarks"))
    ap.add_argument("--gpu", action="store_true", help="also the GPU path's device-side floor")
    ap.add_argument("--many-files", action="store_true", help="also pwrite into one file per thread")
    ap.add_argument("--in-flight", type=int, default=None, help="shards written at once in the interleaved copy "
                    "(default: porter.pipeline.shards_in_flight(--threads))")
    ap.add_argument("--inline", action="store_true", help="also the copy with writeback started inline")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np
    import porter
    from porter.pipeline import Writeback, interleave_shards, shards_in_flight, start_writeback
    from porter.format.safetensors_io import pread_into, pwrite_all
    src = Path(args.src)
    files = sorted(src.glob("*.safetensors"))
    src_sizes = [f.stat().st_size for f in files]
    dry = porter.convert(src, Path(args.tmp) / "floor-dry-run", dry_run=True, max_shard_size=args.max_shard_size)
    out_sizes = [n for _, n in dry["shards"]]
    src_gb, out_gb = sum(src_sizes) / 1e9, sum(out_sizes) / 1e9
    n = args.threads
    data = memoryview(np.random.default_rng(0).integers(0, 256, PIECE, dtype=np.uint8))
    bufs = threading.local()
    res = {"threads": n, "source_gb": src_gb, "output_gb": out_gb, "output_shards": len(out_sizes), "runs": {}}

    def buf():
        if getattr(bufs, "b", None) is None:
            bufs.b = memoryview(bytearray(PIECE))
        return bufs.b
    src_fds = [os.open(f, os.O_RDONLY) for f in files]
    read_jobs = pieces(src_sizes)

    def read(job):
        i, o, k = job
        pread_into(src_fds[i], buf()[:k], o, files[i])
    for f in files:  # warm
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    res["runs"]["read"] = {"seconds": run_threads(n, read_jobs, read), "gb": src_gb}

    def write_run(name: str, sizes: list, how: str = "pwrite", copy: bool = False, width: int = 0):
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            fds = open_outputs(Path(tmp), sizes)
            flusher = Writeback() if how == "thread" else None
            wb_fds = [flusher.open(fd) for fd in fds] if flusher else []
            jobs = pieces(sizes)
            if width:  # round-robin over `width` files at a time, each file's pieces in order
                jobs = interleave_shards(jobs, lambda job: job[0], width)
            if copy:  # each output piece paired with its share of the source pieces
                per = len(read_jobs) / max(1, len(jobs))
                jobs = [(j, read_jobs[int(k * per):int((k + 1) * per)]) for k, j in enumerate(jobs)]

            def write(job):
                if copy:
                    job, reads = job
                    for r in reads:
                        read(r)
                i, o, k = job
                pwrite_all(fds[i], data[:k], o)
                if flusher is not None and wb_fds[i] is not None:
                    flusher.submit(wb_fds[i], o, k)
                elif how in ("inline", "thread"):  # thread: past Writeback.MAX_FDS files, inline as porter does
                    start_writeback(fds[i], o, k)
            secs = run_threads(n, jobs, write)
            if flusher is not None:
                for fd in wb_fds:
                    if fd is not None:
                        flusher.close(fd)
                flusher.stop()
            sync = fsync_all(fds, n)
            for fd in fds:
                os.close(fd)
        res["runs"][name] = {"seconds": secs, "fsync_seconds": sync, "gb": sum(sizes) / 1e9}
        print(f"{name:34s} {secs:6.2f} s {sum(sizes) / 1e9 / secs:6.2f} GB/s; + fsync {sync:5.2f} s: "
              f"{sum(sizes) / 1e9 / (secs + sync):5.2f} GB/s" + (
                  f"  (source {src_gb / secs:5.2f} GB/s, + fsync {src_gb / (secs + sync):5.2f} GB/s)" if copy else ""),
              flush=True)

    r = res["runs"]["read"]
    print(f"{len(out_sizes)} output shards, {out_gb:.2f} GB from {src_gb:.2f} GB source, {n} threads")
    print(f"{'read (page cache)':34s} {r['seconds']:6.2f} s {src_gb / r['seconds']:6.2f} GB/s", flush=True)
    write_run("(warm-up, not a result) write", out_sizes)  # first writes after a build reclaim memory
    res["runs"].pop("(warm-up, not a result) write")
    write_run("write, pwrite, shard layout", out_sizes)
    total = sum(out_sizes)
    if args.many_files:
        write_run(f"write, pwrite, {n} files", [total // n + (i < total % n) for i in range(n)])
    write_run("copy, pwrite, shard layout", out_sizes, copy=True)
    if args.inline:
        write_run("copy, pwrite + writeback inline", out_sizes, "inline", copy=True)
    write_run("copy, pwrite + writeback thread", out_sizes, "thread", copy=True)
    width = args.in_flight or shards_in_flight(n)
    res["in_flight"] = width
    write_run(f"copy, + writeback thread, {width} at once", out_sizes, "thread", copy=True, width=width)
    for fd in src_fds:
        os.close(fd)
    if args.gpu:
        try:
            res["gpu"] = gpu_floor(n, tmp=args.tmp)
        except Exception as e:  # noqa: BLE001 — the disk floor above stands on its own
            print(f"gpu floor failed: {type(e).__name__}: {e}", flush=True)
    shutil.rmtree(Path(args.tmp) / "floor-dry-run", ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
