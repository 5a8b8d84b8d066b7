"""Where a conversion's CPU time goes: core-seconds per stage of `porter convert`, from a warm page cache.

Wraps the pipeline's stage functions with per-thread CPU clocks (time.thread_time, so waiting is not
counted): porter.format.mxfp8.quantize_with_error (the CPU quantizer; on the GPU path its host side: launches
and the finiteness check's wait), GPU quantize (Pipeline._quantize_cuda: host-side time of copies, kernels
launched and waited for), source reads (TensorReader.read/read_bytes),
pwrite, digests (TensorDigest.add: every chunk hash of the output) and the part of them that reads written
bytes back (read_chunk_digest), early writeback (sync_file_range), slab allocation, prefault and
registration, the submitting thread's wait on the memory budget, and on the GPU path the two waits for the
device inside a part (the finiteness check's sync, the final stream.synchronize: the rest of the GPU section
is host time: launches and waits for the GIL); for each also the threads' wall-clock
seconds inside it (time.perf_counter): wall minus CPU is waiting there (a lock, a full disk queue, the GPU).
--sample also samples the workers' Python stacks every 2 ms; the sampler needs the GIL to take a sample, so
the samples lean toward moments when the workers do not hold it (in round 7 they showed 30-59% "idle in the
pool" where the unit trace showed all 16 workers inside a unit 75-77% of the run: trust the trace). On
--device cuda the CUDA context is created and the fused quantizer's kernel loaded
(porter.pipeline.fused_quantizer) before the clock starts (their seconds printed apart: one-time costs of a
conversion). Prints them with the process's user and
system time, wall time split at the pipeline's marks (planning, until the first unit starts, the units,
the finish with its fsync) and the final fsync. Checkpoint: the synthetic real-dims one of convert_throughput.py.

    python benchmarks/convert_profile.py [--gb 2] [--experts 8] [--workers N] [--device cpu] [--out FILE]
                                         [--src DIR] [--sample] [--max-shard-size 5GB]
PORTER_WRITEBACK / PORTER_SHARDS_IN_FLIGHT / PORTER_SLAB_PREFAULT in the environment pick porter.pipeline's
modes.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def instrument(device: str = "cpu") -> tuple[collections.Counter, collections.Counter]:
    """(core-seconds, thread-seconds of wall clock) per stage: their difference is time a thread spent
    waiting inside the stage (a lock, a full disk queue, the GPU, the GIL)."""
    from porter import pipeline
    from porter.format import mxfp8, safetensors_io
    spent, waited, lock = collections.Counter(), collections.Counter(), threading.Lock()

    def wrap(owner, name, key):
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            t, w = time.thread_time(), time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                with lock:
                    spent[key] += time.thread_time() - t
                    waited[key] += time.perf_counter() - w
        setattr(owner, name, timed)
    wrap(mxfp8, "quantize_with_error", "quantize_with_error (CPU; GPU: launches)")
    wrap(pipeline.Pipeline, "_quantize_cuda", "quantize on the GPU (host side)")
    wrap(safetensors_io.TensorReader, "read", "source reads (pread)")
    wrap(safetensors_io.TensorReader, "read_bytes", "source reads (pread)")
    wrap(pipeline, "pwrite_all", "pwrite")
    wrap(pipeline.Pipeline, "_new_slab", "new slabs (GPU path: + prefault, or + register)")
    wrap(pipeline.Pipeline, "_register", "cudaHostRegister")
    wrap(pipeline, "prefault", "prefault (madvise + memset)")
    wrap(pipeline.Budget, "acquire", "budget wait (submitting thread)")
    wrap(pipeline.TensorDigest, "add", "digests (all chunk hashes)")
    wrap(pipeline, "read_chunk_digest", "  of which read back + hash")
    wrap(pipeline, "start_writeback", "sync_file_range")
    wrap(mxfp8, "_check_finite", "  of which the finiteness check (GPU: waits for the part's copy + first kernels)")
    import torch
    wrap(torch.cuda.Stream, "synchronize", "GPU wait at the end of a part (stream.synchronize)")
    if device != "cuda":
        return spent, waited
    # the GPU section's other steps (in porter-convert threads: Tensor.to and copy_ also run elsewhere)
    in_worker = lambda: threading.current_thread().name.startswith("porter-convert")  # noqa: E731

    def wrap_in_workers(owner, name, key):
        real = getattr(owner, name)
        wrap(owner, name, key)
        timed = getattr(owner, name)
        setattr(owner, name, lambda *a, **k: timed(*a, **k) if in_worker() else real(*a, **k))
    wrap_in_workers(torch.Tensor, "to", "  GPU section: Tensor.to (part -> GPU, stats -> host)")
    wrap_in_workers(torch.Tensor, "copy_", "  GPU section: Tensor.copy_ (results -> pinned host)")
    wrap(pipeline.Pipeline, "_register_pending", "  GPU section: _register_pending")
    wrap(pipeline.Pipeline, "_fused", "  GPU section: _fused")
    try:
        from porter.format import mxfp8_triton
        wrap(mxfp8_triton, "quantize_with_error", "  GPU section: fused quantizer launches")
    except ImportError:
        pass
    return spent, waited


def sample_stacks(stop: threading.Event, every: float = 0.002) -> collections.Counter:
    """Where the conversion's worker threads are, sampled every `every` s: the innermost frame in porter/
    (file:function:line) with the innermost frame of all (a C call shows as its Python caller)."""
    import sys as _sys
    seen = collections.Counter()
    names = {}

    def loop():
        while not stop.is_set():
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in _sys._current_frames().items():
                if not names.get(ident, "").startswith("porter-convert"):
                    continue
                top, here = frame, None
                f = frame
                while f is not None:
                    if "/porter/" in f.f_code.co_filename and here is None:
                        here = f
                    f = f.f_back
                where = lambda fr: f"{Path(fr.f_code.co_filename).name}:{fr.f_code.co_name}:{fr.f_lineno}"  # noqa: E731
                seen[(where(here) if here else "-") + " <- " + where(top) if here is not top else where(top)] += 1
            time.sleep(every)
    threading.Thread(target=loop, daemon=True).start()
    return seen


def trace_summary(marks: dict, workers: int) -> dict:
    """From timeline()'s trace: how many units ran at once over the units' span (share of the span with k
    running), when the last unit started (the queue was empty after it: the drain), the longest units, the
    journal writes, and the budget waits that were long (> 1 ms)."""
    units = sorted(marks["units"])
    t0, t1 = units[0][0], max(u[1] for u in units)
    edges = sorted([(u[0], 1) for u in units] + [(u[1], -1) for u in units])
    share, running, last = collections.Counter(), 0, t0
    for t, d in edges:
        share[running] += t - last
        running, last = running + d, t
    span = t1 - t0
    busy = sum(k * v for k, v in share.items()) / span
    by_kind = collections.defaultdict(list)
    for u in units:
        by_kind[u[2]].append(u[1] - u[0])
    waits = [(a - t0, b - a) for a, b in marks["budget"] if b - a > 1e-3]
    # steady state: source bytes processed per second between the end of the first wave (the workers' first
    # units: new streams, slabs, registrations, allocator pools) and the start of the drain, each unit's bytes
    # counted in proportion to its overlap with that window. Needs several waves (at 16 workers, more than ~3 GB).
    first_of = {}  # thread -> its first unit (units are sorted by start)
    for u in units:
        first_of.setdefault(u[5], u)
    wave_end = max(u[1] for u in first_of.values())
    lo, hi = wave_end, units[-1][0]
    steady = (sum(u[4] * max(0.0, min(u[1], hi) - max(u[0], lo)) / (u[1] - u[0]) for u in units if u[1] > u[0])
              / (hi - lo) / 1e9) if hi > lo else None
    return {"span_s": span, "workers": workers, "mean_running": busy,
            "first_wave_end_s": wave_end - t0, "steady_gb_per_s": steady,
            "units_raw": [(u[0] - t0, u[1] - t0, u[2], u[3], u[4], u[5]) for u in units],
            "share_running": {k: v / span for k, v in sorted(share.items())},
            "last_unit_start_s": units[-1][0] - t0, "drain_s": t1 - units[-1][0],
            "unit_seconds_by_kind": {k: {"n": len(v), "mean": sum(v) / len(v), "max": max(v)}
                                     for k, v in by_kind.items()},
            "longest_units": [{"start_s": u[0] - t0, "seconds": u[1] - u[0], "kind": u[2], "tensor": u[3],
                               "mb": u[4] / 1e6} for u in sorted(units, key=lambda u: u[0] - u[1])[:8]],
            "journal_writes": [(a - t0, b - a) for a, b in marks["journal"]],
            "budget_waits": {"n": len(waits), "seconds": sum(w for _, w in waits),
                             "longest": sorted(waits, key=lambda w: -w[1])[:5]}}


def timeline() -> dict:
    """Wall-clock marks of the pipeline (seconds from time.perf_counter): run start/end, first unit start,
    last unit end; and a trace: every unit's (start, end, kind, tensor, source bytes, thread), every journal
    write's (start, end) and every start of the submitting thread's wait on the memory budget."""
    from porter import pipeline
    marks, lock = {"units": [], "journal": [], "budget": []}, threading.Lock()
    run, unit = pipeline.Pipeline.run, pipeline.Pipeline._run_unit

    def record_intervals(owner, name, key):  # each call's (start, end) appended to marks[key]
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                marks[key].append((t, time.perf_counter()))
        setattr(owner, name, timed)
    record_intervals(pipeline.Pipeline, "_closed", "journal")
    record_intervals(pipeline.Budget, "acquire", "budget")

    def timed_run(self, units):
        marks["run_start"] = time.perf_counter()
        try:
            return run(self, units)
        finally:
            marks["run_end"] = time.perf_counter()

    def timed_unit(self, u):
        t = time.perf_counter()
        with lock:
            marks["first_unit_start"] = min(marks.get("first_unit_start", t), t)
        try:
            return unit(self, u)
        finally:
            with lock:
                marks["last_unit_end"] = end = time.perf_counter()
                marks["units"].append((t, end, u.kind, u.t.name, u.src_bytes, threading.current_thread().name))
    pipeline.Pipeline.run, pipeline.Pipeline._run_unit = timed_run, timed_unit
    return marks


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tmp", default=str(ROOT / "benchmarks"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--src", default=None, help="an existing checkpoint folder instead of building one")
    ap.add_argument("--cold", action="store_true", help="empty the page cache of the source first (from disk; "
                    "convert_throughput.evict) instead of warming it")
    ap.add_argument("--sample", action="store_true", help="also sample the workers' stacks every 2 ms")
    ap.add_argument("--max-shard-size", default="5GB", help="porter convert --max-shard-size (output shards)")
    ap.add_argument("--digest", default=None, help="porter convert --digest (the chunk hash; default: porter's)")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run (s; "
                    "Python's default 0.005): whether the GIL's hand-over between the workers moves the time")
    args = ap.parse_args()
    import convert_throughput as ct
    import porter
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        src = Path(args.src) if args.src else ct.build_checkpoint(Path(tmp) / "src", max(2, round(args.gb * 0.85)),
                                                                 args.experts)
        gb = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 1e9
        if args.cold:
            ct.evict(src)
        else:
            ct.warm(src)
        cuda_init = quantizer_init = quantizer = None
        if args.device == "cuda":  # the CUDA context is made before the clock starts (its cost printed apart)
            import torch
            c0 = time.perf_counter()
            torch.zeros(1, device="cuda")
            cuda_init = time.perf_counter() - c0
            from porter import pipeline  # and the fused quantizer's kernel loaded: a one-time cost as well
            c0 = time.perf_counter()
            quantizer = pipeline.fused_quantizer(torch.device("cuda"), "rceil")
            quantizer_init = time.perf_counter() - c0
        (spent, waited), marks = instrument(args.device), timeline()
        if args.switch_interval is not None:
            sys.setswitchinterval(args.switch_interval)
        stop = threading.Event()
        stacks = sample_stacks(stop) if args.sample else collections.Counter()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        done = porter.convert(src, Path(tmp) / "out", progress=False, workers=args.workers, device=args.device,
                              max_shard_size=args.max_shard_size, **({"digest": args.digest} if args.digest else {}))
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        stop.set()
        t_end = t0 + wall
        shutil.rmtree(Path(tmp) / "out", ignore_errors=True)
    result = {"machine": ct.machine(), "source_gb": gb, "workers": done["workers"], "device": done["device"],
              "digest": args.digest or "default",
              "output_shards": done["shards"], "max_shard_size": args.max_shard_size,
              "wall_seconds": wall, "fsync_seconds": done["fsync_seconds"],
              "user_seconds": r1.ru_utime - r0.ru_utime, "system_seconds": r1.ru_stime - r0.ru_stime,
              "core_seconds": dict(spent.most_common()),
              "thread_wall_seconds": dict(waited.most_common()), "cuda_context_seconds": cuda_init,
              "fused_quantizer_load_seconds": quantizer_init, "fused_quantizer": quantizer is not None,
              "stack_samples": dict(stacks.most_common(25)),
              "env": {k: v for k, v in os.environ.items() if k.startswith("PORTER_")},
              "switch_interval": sys.getswitchinterval(),
              "wall": {"plan_and_open": marks["run_start"] - t0,
                       "until_first_unit": marks["first_unit_start"] - marks["run_start"],
                       "units": marks["last_unit_end"] - marks["first_unit_start"],
                       "after_last_unit": marks["run_end"] - marks["last_unit_end"],
                       "finish_incl_fsync": t_end - marks["run_end"]},
              "trace": trace_summary(marks, done["workers"])}
    print(f"{gb:.2f} GB, {done['shards']} output shards, {done['workers']} workers, {done['device']}: "
          f"{wall:.2f} s ({gb / wall:.2f} GB/s; "
          f"fsync {done['fsync_seconds']:.2f} s), user {result['user_seconds']:.2f} s, "
          f"system {result['system_seconds']:.2f} s")
    if cuda_init is not None:
        print(f"  CUDA context (before the clock): {cuda_init:.2f} s; fused quantizer "
              f"{'loaded' if quantizer else 'not used'} (before the clock): {quantizer_init:.2f} s")
    print("  wall: " + ", ".join(f"{k} {v:.2f} s" for k, v in result["wall"].items()))
    tr = result["trace"]
    print(f"  units: {tr['mean_running']:.1f} of {tr['workers']} running on average over {tr['span_s']:.2f} s; "
          f"last unit started at {tr['last_unit_start_s']:.2f} s (drain {tr['drain_s']:.2f} s); share of the span "
          "with k running: " + ", ".join(f"{k}: {v:.0%}" for k, v in tr["share_running"].items() if v >= 0.01))
    print(f"  first wave (each worker's first unit) done at {tr['first_wave_end_s']:.2f} s; steady state between "
          f"it and the drain: " + (f"{tr['steady_gb_per_s']:.2f} GB/s of source" if tr["steady_gb_per_s"]
                                   else "none (too few units: the run is all head and tail)"))
    print("  unit seconds by kind: " + ", ".join(f"{k} n={v['n']} mean {v['mean']:.3f} max {v['max']:.3f}"
                                                 for k, v in tr["unit_seconds_by_kind"].items()))
    print("  longest units: " + "; ".join(f"{u['kind']} {u['tensor'].split('.')[-2:]} {u['mb']:.0f} MB "
                                          f"{u['seconds']:.3f} s at {u['start_s']:.2f}" for u in tr["longest_units"][:5]))
    print("  journal writes (start s, seconds): " + ", ".join(f"({a:.2f}, {b:.3f})" for a, b in tr["journal_writes"]))
    print(f"  budget waits > 1 ms: {tr['budget_waits']['n']}, {tr['budget_waits']['seconds']:.2f} s; longest "
          + ", ".join(f"({a:.2f}, {b:.3f})" for a, b in tr["budget_waits"]["longest"]))
    for k, v in waited.most_common():
        print(f"  {k:44s} {spent[k]:7.2f} core-s {v:7.2f} thread-s of wall")
    total = sum(stacks.values())
    for k, v in stacks.most_common(15):
        print(f"  {100 * v / total:5.1f}% of worker samples  {k}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
