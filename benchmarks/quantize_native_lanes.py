"""The compiled CPU quantizer (porter/format/mxfp8_cpu.c) at 8 and at 16 lanes, on this machine's CPU.

Builds the file twice with porter.format.mxfp8_native's flags plus -DPORTER_LANES=8 / 16 (and once as porter
builds it, with no -D: 16 lanes where the compiler targets AVX-512F, else 8), loads each with ctypes and
quantizes one bf16 expert matrix at MiniMax-M3's dims ([2I, H] = [6144, 6144] by default) with error
statistics, on 1 thread and on --threads threads (ctypes releases the GIL), builds interleaved over --repeats
rounds; GB/s counts bf16 input bytes (best of the rounds). All builds must give the same codes and scale bytes
and the same max |error|; the per-block sums differ only in fp32 summation order (bound 3.7e-6 relative, as
tests/test_mxfp8_native.py states). The run fails otherwise.

    python benchmarks/quantize_native_lanes.py [--shape 6144,6144] [--threads 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from porter.format import mxfp8_native  # noqa: E402


def build(tmp: Path, lanes):
    """The quantizer built with -DPORTER_LANES=lanes (None: as porter builds it), bound through ctypes."""
    return mxfp8_native.build_variant(tmp / f"q{lanes or 'default'}.so",
                                      () if lanes is None else (f"-DPORTER_LANES={lanes}",))


def outputs(w: torch.Tensor) -> tuple:
    """(codes, scale bytes, stats [NB, 3]) for w, touched once so no timed call pays their page faults."""
    nb = w.numel() // 32
    return torch.zeros(w.numel(), dtype=torch.uint8), torch.zeros(nb, dtype=torch.uint8), torch.zeros(nb, 3)


def run(fn, w: torch.Tensor, threads: int, out: tuple) -> float:
    """Quantize w's blocks split over `threads` callers into `out`; -> seconds."""
    nb = w.numel() // 32
    q, s, st = out
    per = -(-nb // threads)
    jobs = [(b, min(per, nb - b)) for b in range(0, nb, per)]

    def one(job):
        b, n = job
        fn(w.data_ptr() + b * 64, 1, n, 0, q.data_ptr() + b * 32, s.data_ptr() + b, st.data_ptr() + b * 12)
    with ThreadPoolExecutor(threads) as pool:
        t = time.perf_counter()
        list(pool.map(one, jobs))
        return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="6144,6144")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16().contiguous()
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    result = {"cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name")), platform.processor()),
              "avx512f": " avx512f" in flags, "shape": shape, "threads": args.threads, "gb": w.numel() * 2 / 1e9,
              "builds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        fns = {str(lanes or "default"): build(Path(tmp), lanes) for lanes in (8, 16, None)}
        best = {(k, t): float("inf") for k in fns for t in (1, args.threads)}
        outs = {k: outputs(w) for k in fns}
        for _ in range(args.repeats):
            for k, fn in fns.items():
                for t in (1, args.threads):
                    best[k, t] = min(best[k, t], run(fn, w, t, outs[k]))
    q8, s8, st8 = outs["8"]
    for k, (q, s, st) in outs.items():
        same = torch.equal(q, q8) and torch.equal(s, s8) and torch.equal(st[:, 2], st8[:, 2])
        sums = (st[:, :2].double().sum(0) - st8[:, :2].double().sum(0)).abs() / st8[:, :2].double().sum(0)
        result["builds"][k] = {f"gb_per_s_{t}_threads": result["gb"] / best[k, t] for t in (1, args.threads)}
        result["builds"][k] |= {"same_bytes_as_8_lanes": same, "sum_rel_diff_vs_8_lanes": sums.max().item()}
        print(f"{k:>7} lanes: {result['gb'] / best[k, 1]:.2f} GB/s on 1 thread, "
              f"{result['gb'] / best[k, args.threads]:.2f} GB/s on {args.threads}; same bytes as 8 lanes {same}, "
              f"error sums differ by {sums.max().item():.1e} relative", flush=True)
        if not same or sums.max().item() > 3.7e-6:
            raise SystemExit(f"the {k}-lane build differs from the 8-lane build")
    print(f"{result['cpu']} (AVX-512F: {result['avx512f']}), bf16 {shape}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
