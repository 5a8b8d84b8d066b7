"""Where the MoE layer's idle-GPU replay time goes (diagnosis, not a record).

benchmarks/moe_layer.py times each layer twice: a CUDA-graph replay from an idle GPU and one queued behind
GPU work. From round 10 on, the MXFP8 layer paid far more for the idle start than its bf16 twin at the
same T (T=4: ~25 us against ~3; T=16: 80-100 us against ~5), though both run the same kernels. This
probe, at MiniMax-M3 dims (E 128, H 6144, I 3072, top-4), per T and for both weight kinds:

- idle and queued graph medians, measured in an interleaved order and repeated, so a first-measured
  effect shows;
- the host time of one graph replay call (GPU kept busy, so the call never waits);
- the same with programmatic dependent launch off (triton_backend.USE_PDL = False);
- a kernel trace (torch.profiler) of idle replays: per kernel, its duration and the gap before it, and
  the gap between the replay's first event and its first kernel.

What it found on the H200 (round 13, two runs: benchmarks/results/moe_round13_call{1,8}_idle_probe.log):
timed interleaved, both kinds read 8-30 us above their queued times at T=4 and 16, with PDL on or off, and
one graph replay costs the host 14-46 us for either. The excess was the layer benchmark's order: it timed
the MXFP8 layer's idle replay once, right after the path choice and the torch reference, and its twin
later; benchmarks/moe_layer.py now times both in interleaved rounds (timed_rounds).

    python benchmarks/moe_idle_probe.py [--tokens 1,4,16,64] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import moe_layer as ml  # noqa: E402
from runtime.moe import triton_backend as tb  # noqa: E402


def host_replay_us(g, reps=40) -> float:
    """Median host time (us) of g.replay() while the GPU is busy with a ~1 ms spin (the call never waits)."""
    times = []
    for _ in range(reps):
        torch.cuda._sleep(2_000_000)
        t0 = time.perf_counter()
        g.replay()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def trace(g, reps=8) -> dict:
    """Kernel names, durations and gaps (us) over idle replays of g, from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            g.replay()
            torch.cuda.synchronize()
            time.sleep(0.002)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    ev = json.load(open(path))["traceEvents"]
    os.unlink(path)
    kern = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")), key=lambda e: e["ts"])
    launches = sorted((e for e in ev if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")),
                      key=lambda e: e["ts"])
    per = max(1, len(kern) // reps)
    rows = []
    for r in range(reps):
        ks = kern[r * per:(r + 1) * per]
        if not ks:
            break
        launch = launches[r] if r < len(launches) else None
        row = {"launch_to_first_kernel_us": (ks[0]["ts"] - launch["ts"]) if launch else None,
               "launch_call_us": launch["dur"] if launch else None,
               "span_us": ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"],
               "kernels": [{"name": k["name"][:40], "dur": k["dur"],
                            "gap_before": (k["ts"] - (ks[i - 1]["ts"] + ks[i - 1]["dur"])) if i else 0.0}
                           for i, k in enumerate(ks)]}
        rows.append(row)
    return {"kernels_per_replay": per, "replays": rows[2:]}  # the first two replays warm the profiler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    moe, _, bf16, _ = ml.build_layer(dev)
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": []}
    for t in [int(v) for v in args.tokens.split(",")]:
        x, ids, w = ml.decode_problem(t, dev)
        cfg = tb.default_config(t, False)
        fns = {"mxfp8": lambda: moe.forward_topk(x, ids, w, cfg),
               "bf16": lambda: tb.fused_moe(bf16, x, ids, w, ml.RSF, cfg)}
        row = {"T": t, "order": []}
        for rnd in range(2):  # interleaved, twice: idle / queued for each kind
            for kind, fn in fns.items():
                for mode in ("idle", "queued"):
                    us = ml.graph_time_us(fn) if mode == "idle" else ml.graph_time_queued_us(fn)
                    row["order"].append({"round": rnd, "kind": kind, "mode": mode, "us": us})
                    print(f"T={t} round {rnd} {kind:5s} {mode:6s} {us:8.1f} us", flush=True)
        for kind, fn in fns.items():
            g = ml.capture_graph([fn])
            torch.cuda.synchronize()
            row[f"{kind}_host_replay_us"] = host_replay_us(g)
            row[f"{kind}_trace"] = tr = trace(g)
            spans = [r["span_us"] for r in tr["replays"]]
            l2k = [r["launch_to_first_kernel_us"] for r in tr["replays"] if r["launch_to_first_kernel_us"] is not None]
            print(f"T={t} {kind:5s} host replay {row[f'{kind}_host_replay_us']:.1f} us; "
                  f"{tr['kernels_per_replay']} kernels; span median {statistics.median(spans):.1f} us; "
                  f"launch->first kernel {statistics.median(l2k) if l2k else float('nan'):.1f} us", flush=True)
            if tr["replays"]:
                last = tr["replays"][-1]
                print("   " + "; ".join(f"{k['name']} {k['dur']:.1f} (+{k['gap_before']:.1f})"
                                        for k in last["kernels"]), flush=True)
            del g
        tb.USE_PDL = False
        for kind, fn in fns.items():
            for mode in ("idle", "queued"):
                us = ml.graph_time_us(fn) if mode == "idle" else ml.graph_time_queued_us(fn)
                row[f"{kind}_nopdl_{mode}_us"] = us
                print(f"T={t} no PDL {kind:5s} {mode:6s} {us:8.1f} us", flush=True)
        tb.USE_PDL = None
        res["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
