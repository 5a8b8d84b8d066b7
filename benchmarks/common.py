"""What the benchmarks share: the repository on sys.path, environment capture, CUDA-graph timing, the
measured bandwidth floors, markdown tables and result files, real-dims checkpoints and the page cache's
state (warm, evicted, how much is cached). Not imported by porter or runtime."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REAL_VOCAB = 200064  # MiniMax-M3's vocab_size (docs/minimax-m3.md)
ROOT = Path(__file__).resolve().parents[1]
# git-ignored (/benchmarks/tmp*/); the curated figures live in docs/performance.md
DEFAULT_OUT = ROOT / "benchmarks" / "tmp-results"
for p in (ROOT, ROOT / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def commit() -> str:
    """The repository's HEAD (short sha, '+dirty' when the tree differs), or 'unknown' outside git."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """What a result needs beside it: CPU, cores, memory, GPU, torch, triton, commit, command."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    env = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "mem_total_gb": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": None,
        "commit": commit(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def environment_line(env: dict) -> str:
    gpu = f", GPU {env['gpu']}" if env.get("gpu") else ""
    return (
        f"{env['cpu']}, {env['cores']} cores{gpu}; torch {env['torch']}, triton {env['triton']}, "
        f"python {env['python']}; commit {env['commit']}; `python benchmarks/{env['command']}`"
    )


def capture_graph(calls: list):
    """A CUDA graph of the callables run back to back: 3 warm-up runs on a side stream, capture, 5 replays."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(5):
        g.replay()
    return g


BUSY_CYCLES = 200_000  # ~100 us of GPU spin queued ahead of each timed replay (graph_time_queued_us)


def graph_time_us(fn, reps: int = 60, calls: list | None = None, busy_cycles: int = 0) -> float:
    """Median of per-replay event timings of a CUDA graph of fn (launch gaps between its kernels included,
    CPU launch cost not). calls: callables captured back to back instead of fn; the median is divided by
    their number. busy_cycles: GPU spin queued ahead of each timed replay."""
    import torch

    calls = calls or [fn]
    g = capture_graph(calls)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)


def graph_time_queued_us(fn, reps: int = 60, calls: list | None = None) -> float:
    """graph_time_us with each replay queued behind ~100 us of GPU spin, so the CPU's graph launch is done
    before the GPU reaches it: GPU time only, as inside a decode step, where the CPU runs ahead."""
    return graph_time_us(fn, reps, calls, BUSY_CYCLES)


def event_time_us(fn, reps: int) -> float:
    """Median of per-call event timings of fn launched eagerly (after one warm-up call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def mean_ms(fn, iters: int = 50, graph: bool = True) -> float:
    """Mean ms per call over `iters` back-to-back calls; graph=True captures fn once and replays it."""
    import torch

    run = capture_graph([fn]).replay if graph else fn
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth() -> float:
    """Device copy rate in bytes/s, read + write of a 2 GiB buffer (the decode step's bytes floor rate)."""
    import torch

    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    return 2 * x.numel() / (mean_ms(lambda: y.copy_(x), iters=20, graph=False) / 1e3)


def markdown_table(header: list, rows: list) -> list:
    """Lines of a markdown table; cells are used as given (format numbers before)."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in r) + " |" for r in rows),
    ]


def write_results(out_dir, stem: str, doc: dict, lines: list) -> Path:
    """<out_dir>/<stem>.json (doc) and .md (lines); prints the markdown. Returns the .md path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return md


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
        return self._pool[self._at : self._at + n].view(*shape)

    def __getattr__(self, name):
        return getattr(self._torch, name)


def build_checkpoint(
    out: Path,
    layers: int,
    experts: int,
    vocab: int | None = None,
    family: str = "m3",
    overrides: dict | None = None,
    dims=None,
) -> Path:
    """A checkpoint at the family's real layer dims with random weights from a shared pool: family "m3" is
    MiniMax-M3's vendor layout (examples/tiny_checkpoint.py), "m2-fp8" / "m2-bf16" MiniMax-M2's FP8-block /
    bf16 vendor layouts (examples/minimax_m2_tiny_checkpoint.py); vocab: the embedding's rows (None: the
    fixture's tokenizer's); overrides: further config keys (e.g. max_position_embeddings); dims: (hidden,
    expert intermediate) of a smaller synthetic M3 instead of the real dims (a CPU-sized run)."""
    import minimax_m2_tiny_checkpoint as m2
    import tiny_checkpoint

    module = tiny_checkpoint if family == "m3" else m2
    real = module.torch
    module.torch = _PooledRandn(real)
    try:
        if family == "m3" and dims:
            config = tiny_checkpoint.synthetic_overrides(layers, *dims, experts=experts)
        elif family == "m3":
            config = tiny_checkpoint.real_dims_overrides(layers, experts)
        else:
            config = m2.real_dims_overrides(layers, experts)
        if vocab is not None:
            config["vocab_size"] = vocab
        config |= overrides or {}
        if family == "m3":
            return tiny_checkpoint.build_tiny_checkpoint(out, text_overrides=config, max_shard_tensors=40)
        return m2.build_m2_checkpoint(out, "fp8" if family == "m2-fp8" else "vendor", overrides=config)
    finally:
        module.torch = real


def evict(path: Path, drop_caches: bool = True) -> str:
    """Empty the page cache for a cold run; returns how (drop_caches as root unless drop_caches=False, else
    fadvise on the sources)."""
    os.sync()
    if drop_caches and os.geteuid() == 0:
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
