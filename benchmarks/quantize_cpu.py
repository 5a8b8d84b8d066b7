"""CPU MXFP8 quantization throughput per core: porter.format.mxfp8 now vs an earlier revision of it.

The conversion pipeline quantizes a weight in chunks of porter.pipeline.QUANT_CHUNK_ELEMS elements with
`mxfp8.quantize_with_error` (bytes + exact error statistics) when it runs 2 workers or fewer (past 2 workers,
porter.pipeline.quant_sizes: one 4M-element tile per call, which this benchmark does not time). This times
exactly that on one bf16 weight at
MiniMax-M3's real dims ([6144, 6144] by default, ~75 MB of bf16) with 1 and 2 torch threads and 2 workers, and plain
`quantize` for reference. The baseline is porter/mxfp8.py (its path before porter/format/) as of
`--baseline` (read with `git show` and loaded as a throwaway module, nothing copied into the tree). Both must
give the same bytes and the same error statistics on the benchmark matrix; the run fails otherwise.

GB/s counts bf16 input bytes; "per core" divides by threads x workers (workers: that many Python threads
calling in parallel, 1 torch thread each, the way porter convert's CPU workers run). Timings are the minimum
(and median) over --repeats passes, old and new interleaved so that load from other processes hits both alike.

Whole conversions are timed by benchmarks/convert_throughput.py (stage by stage: benchmarks/convert_profile.py).
(An earlier `--convert-rounds` A/B ran porter convert with the baseline's mxfp8.py swapped in; the pipeline now
calls quantize_with_error with tile sizes that file does not take. Its recorded result stays in
benchmarks/results/quantize_cpu.json.)

    python benchmarks/quantize_cpu.py --out benchmarks/results/quantize_cpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from porter.format import mxfp8  # noqa: E402
from porter.pipeline import QUANT_CHUNK_ELEMS  # noqa: E402


def load_revision(rev: str):
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:porter/mxfp8.py"], capture_output=True, text=True,
                         check=True).stdout
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(f"mxfp8_{rev}", loader=None))
    exec(compile(src, f"{rev}:porter/mxfp8.py", "exec"), module.__dict__)
    return module


def chunks(w: torch.Tensor, chunk_elems: int):
    rows = max(1, chunk_elems // w.shape[-1])
    return [w[r:r + rows] for r in range(0, w.shape[0], rows)]


def run_all(module, fn: str, parts: list, rounding: str, pool=None):
    f = getattr(module, fn)
    if pool is None:
        return [f(p, rounding) for p in parts]
    return list(pool.map(lambda p: f(p, rounding), parts))


def check_same(old_out, new_out) -> None:
    for (qa, sa, *ea), (qb, sb, *eb) in zip(old_out, new_out):
        assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8)), "values differ"
        assert torch.equal(sa, sb), "scales differ"
        if ea:
            for k in ea[0]:
                a, b = ea[0][k], eb[0][k]
                assert a == b and math.copysign(1, a) == math.copysign(1, b), f"{k}: {a!r} != {b!r}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="d5e822f", help="git revision of porter/mxfp8.py to compare against")
    ap.add_argument("--shape", default="6144,6144", help="bf16 weight shape (N,K)")
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts to run (one caller)")
    ap.add_argument("--workers", default="2", help="caller thread counts to run with 1 torch thread each, as "
                    "porter convert's CPU workers do ('' for none)")
    ap.add_argument("--chunk-elems", type=int, default=QUANT_CHUNK_ELEMS,
                    help="elements per quantize call (the pipeline's CPU chunk)")
    ap.add_argument("--rounding", default="rceil", choices=mxfp8.ROUNDING_MODES)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    old = load_revision(args.baseline)
    n, k = (int(v) for v in args.shape.split(","))
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)  # [N, K]
    parts = chunks(w, args.chunk_elems)
    gb = w.numel() * w.element_size() / 1e9
    rows = []
    configs = [(int(t), 1) for t in args.threads.split(",") if t]
    configs += [(1, int(n)) for n in args.workers.split(",") if n]
    for threads, workers in configs:
        torch.set_num_threads(threads)
        pool = ThreadPoolExecutor(workers) if workers > 1 else None
        cores = threads * workers
        for fn in ("quantize_with_error", "quantize"):
            check_same(run_all(old, fn, parts, args.rounding), run_all(mxfp8, fn, parts, args.rounding, pool))
            times = {"old": [], "new": []}
            for _ in range(args.repeats):
                for name, module in (("old", old), ("new", mxfp8)):
                    t0 = time.perf_counter()
                    run_all(module, fn, parts, args.rounding, pool)
                    times[name].append(time.perf_counter() - t0)
            row = {"function": fn, "threads": threads, "workers": workers}
            for name, ts in times.items():
                row[f"{name}_s_min"] = round(min(ts), 4)
                row[f"{name}_s_median"] = round(statistics.median(ts), 4)
                row[f"{name}_gbps"] = round(gb / min(ts), 3)
                row[f"{name}_gbps_per_core"] = round(gb / min(ts) / cores, 3)
            row["speedup_min"] = round(min(times["old"]) / min(times["new"]), 2)
            row["speedup_median"] = round(statistics.median(times["old"]) / statistics.median(times["new"]), 2)
            rows.append(row)
            print(f"{fn:20s} threads {threads} workers {workers}: old {row['old_gbps_per_core']:.3f} GB/s/core "
                  f"(min {row['old_s_min']:.3f} s, median {row['old_s_median']:.3f} s), new "
                  f"{row['new_gbps_per_core']:.3f} GB/s/core (min {row['new_s_min']:.3f} s, median "
                  f"{row['new_s_median']:.3f} s): {row['speedup_min']:.2f}x (medians {row['speedup_median']:.2f}x)",
                  flush=True)
    result = {
        "what": "CPU MXFP8 quantization throughput, GB/s of bf16 input (per core = / (threads x workers))",
        "shape": [n, k], "dtype": "bfloat16", "rounding": args.rounding, "chunk_elems": args.chunk_elems,
        "calls_per_pass": len(parts), "repeats": args.repeats, "baseline": f"{args.baseline}:porter/mxfp8.py",
        "identical_bytes_and_stats": True,
        "host": {"cpu": cpu_model(), "cpus_visible": os.cpu_count(), "torch": torch.__version__,
                 "cpu_capability": torch.backends.cpu.get_cpu_capability(), "python": platform.python_version()},
        "results": rows,
    }
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
