"""MiniMax-M3 at its real structure, for free: sparse files with the release's exact header layout.

Builds a checkpoint with the BF16 release's tensor names, shapes and dtypes (60 layers: 0-2 dense, 3-59
sparse attention + MoE with 128 experts; embeddings, lm_head, the 523-tensor vision tower) in its 59-shard
layout (layer 0 with embed/head/norm in shard 1, layers 1-2 in shard 2, layer l >= 3 in shard l), the
vendor config.json and an index. Every shard is a real safetensors header followed by a hole: ~850 GB
logical, no disk used, and reading it costs no disk I/O (the data is zeros). The tensor list and shard
layout are the BF16 release's (MiniMaxAI/MiniMax-M3 on the Hugging Face Hub: 59 shards, 23,416 tensors,
795.5 GiB; its model.safetensors.index.json), the names those of the MiniMax-M3 converter's vendor layout.

Then, in child processes:
1. `porter convert --dry-run`: wall time and the memory estimate;
2. `porter convert` for --seconds (then killed: the output, ~half the source, would not fit a normal disk):
   source GB/s, ETA for the whole checkpoint, peak RssAnon / RssFile / VmHWM, estimate / measured peak.

    python benchmarks/sparse_checkpoint.py [--seconds 15] [--device auto] [--workers N] [--keep DIR]
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from porter.safetensors_io import Entry, header_bytes  # noqa: E402

H, I, I_DENSE, V, E, LAYERS, DENSE = 6144, 3072, 12288, 200064, 128, 60, 3
BF16, F32 = torch.bfloat16, torch.float32


def real_config() -> dict:
    """The vendor config.json with the release's real values (docs/minimax-m3.md)."""
    from tiny_checkpoint import vendor_config
    freq = [0] * DENSE + [1] * (LAYERS - DENSE)
    text = {"vocab_size": V, "hidden_size": H, "intermediate_size": I, "dense_intermediate_size": I_DENSE,
            "shared_intermediate_size": I, "num_hidden_layers": LAYERS, "num_attention_heads": 64,
            "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 1048576, "num_local_experts": E, "num_experts_per_tok": 4,
            "moe_layer_freq": freq, "num_mtp_modules": 7,
            "sparse_attention_config": {"use_sparse_attention": True, "sparse_index_dim": 128,
                                        "sparse_num_index_heads": 4, "sparse_topk_blocks": 16,
                                        "sparse_block_size": 128, "sparse_score_type": "max",
                                        "sparse_init_block": 0, "sparse_local_block": 1,
                                        "sparse_attention_freq": freq, "sparse_disable_index_value": freq}}
    return vendor_config(text, bos=200034, eos=200020)


def layer_tensors(layer: int) -> list:
    p = f"language_model.model.layers.{layer}."
    out = [(p + "input_layernorm.weight", BF16, (H,)), (p + "post_attention_layernorm.weight", BF16, (H,)),
           (p + "self_attn.q_proj.weight", BF16, (8192, H)), (p + "self_attn.k_proj.weight", BF16, (512, H)),
           (p + "self_attn.v_proj.weight", BF16, (512, H)), (p + "self_attn.o_proj.weight", BF16, (H, 8192)),
           (p + "self_attn.q_norm.weight", BF16, (128,)), (p + "self_attn.k_norm.weight", BF16, (128,))]
    if layer < DENSE:
        return out + [(p + "mlp.gate_proj.weight", BF16, (I_DENSE, H)), (p + "mlp.up_proj.weight", BF16, (I_DENSE, H)),
                      (p + "mlp.down_proj.weight", BF16, (H, I_DENSE))]
    m = p + "block_sparse_moe."
    out += [(p + "self_attn.index_q_proj.weight", BF16, (512, H)), (p + "self_attn.index_k_proj.weight", BF16, (128, H)),
            (p + "self_attn.index_q_norm.weight", BF16, (128,)), (p + "self_attn.index_k_norm.weight", BF16, (128,)),
            (m + "gate.weight", F32, (E, H)), (m + "e_score_correction_bias", F32, (E,)),
            (m + "shared_experts.gate_proj.weight", BF16, (I, H)), (m + "shared_experts.up_proj.weight", BF16, (I, H)),
            (m + "shared_experts.down_proj.weight", BF16, (H, I))]
    for e in range(E):
        out += [(m + f"experts.{e}.w1.weight", BF16, (I, H)), (m + f"experts.{e}.w3.weight", BF16, (I, H)),
                (m + f"experts.{e}.w2.weight", BF16, (H, I))]
    return out


def vision_tensors() -> list:
    """The vision tower (CLIP layout, 32 layers of width 1280), projector and patch merger: 523 tensors."""
    v, d, f = "vision_tower.vision_model.", 1280, 5120
    out = [(v + "embeddings.patch_embedding.weight", F32, (d, 3, 2, 14, 14)),
           (v + "pre_layrnorm.weight", BF16, (d,)), (v + "pre_layrnorm.bias", BF16, (d,))]
    for layer in range(32):
        q = f"{v}encoder.layers.{layer}."
        for x in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out += [(q + f"self_attn.{x}.weight", BF16, (d, d)), (q + f"self_attn.{x}.bias", BF16, (d,))]
        for x in ("layer_norm1", "layer_norm2"):
            out += [(q + f"{x}.weight", BF16, (d,)), (q + f"{x}.bias", BF16, (d,))]
        out += [(q + "mlp.fc1.weight", BF16, (f, d)), (q + "mlp.fc1.bias", BF16, (f,)),
                (q + "mlp.fc2.weight", BF16, (d, f)), (q + "mlp.fc2.bias", BF16, (d,))]
    for name, shape in (("multi_modal_projector.linear_1", (H, d)), ("multi_modal_projector.linear_2", (H, H)),
                        ("patch_merge_mlp.linear_1", (H, 4 * H)), ("patch_merge_mlp.linear_2", (H, H))):
        out += [(name + ".weight", BF16, shape), (name + ".bias", BF16, (shape[0],))]
    return out


def shard_contents() -> list:
    """[(file, [(name, dtype, shape), ...])] in the release's 59-shard layout."""
    first = [("language_model.model.embed_tokens.weight", BF16, (V, H)), ("language_model.model.norm.weight", BF16, (H,)),
             ("language_model.lm_head.weight", BF16, (V, H))] + layer_tensors(0) + vision_tensors()
    groups = [first, layer_tensors(1) + layer_tensors(2)] + [layer_tensors(l) for l in range(DENSE, LAYERS)]
    n = len(groups)
    return [(f"model-{i:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups, 1)]


def build(out: Path) -> dict:
    """Write the sparse checkpoint; returns {"files", "tensors", "logical_bytes"}."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(real_config(), indent=2))
    weight_map, logical, count = {}, 0, 0
    for f, tensors in shard_contents():
        entries = [Entry(n, d, s) for n, d, s in tensors]
        header = header_bytes(entries, {"format": "pt"})
        size = len(header) + sum(e.nbytes for e in entries)
        with open(out / f, "wb") as fh:
            fh.write(header)
            fh.truncate(size)  # a hole: no blocks allocated, reads as zeros
        weight_map |= {n: f for n, _, _ in tensors}
        logical += size
        count += len(tensors)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": logical},
                                                                  "weight_map": weight_map}))
    return {"files": len(shard_contents()), "tensors": count, "logical_bytes": logical}


RUN = """
import json, os, sys, threading, time
sys.path.insert(0, {root!r})
import porter, porter.pipeline as pp
PEAK = {{"RssAnon": 0, "RssFile": 0, "VmHWM": 0}}
def status():  # this process's RssAnon / RssFile / VmHWM, read as porter's --max-memory sizing reads them
    s = pp.memory_status()
    return {{k: s.get(k, 0) for k in PEAK}}
src, out, seconds, device, workers = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
workers = None if workers == "all" else int(workers)
t0 = time.perf_counter()
dry = porter.convert(src, out, dry_run=True, device=device, workers=workers)
dry_s = time.perf_counter() - t0
done = [0]
orig = pp.Pipeline._run_unit
def counted(self, u):
    orig(self, u)
    done[0] += u.src_bytes
pp.Pipeline._run_unit = counted
def work():
    try:
        porter.convert(src, out, progress=False, device=device, workers=workers)
    except Exception as e:
        print("ERROR", type(e).__name__, e, flush=True)
threading.Thread(target=work, daemon=True).start()
t1 = time.perf_counter()
timeline = []
while time.perf_counter() - t1 < seconds:
    time.sleep(0.05)
    s = status()
    for k, v in s.items():
        PEAK[k] = max(PEAK[k], v)
    if not timeline or time.perf_counter() - t1 - timeline[-1][0] >= 1:
        timeline.append((round(time.perf_counter() - t1, 2), done[0], s.get("RssAnon", 0), s.get("RssFile", 0)))
elapsed = time.perf_counter() - t1
print("RESULT " + json.dumps({{"dry_run_seconds": dry_s, "estimate": dry["peak_bytes_estimate"],
                              "memory_estimate": dry["memory_estimate"], "seconds": elapsed,
                              "source_bytes_done": done[0], "peak": PEAK, "timeline": timeline}}), flush=True)
os._exit(0)
"""


def second_half_rate(run: dict) -> float:
    """Source bytes/s over the run's second half (from the first timeline sample at or past half its seconds).
    The first seconds can run far above the steady rate while the output only fills the page cache (on the
    H200 machine, --device cuda: ~9 GB/s for 7 s, then ~4 GB/s once writeback paced it), so a run of a few
    tens of seconds overstates what the whole checkpoint would see; the second half is closer to it."""
    mid = next((p for p in run["timeline"] if p[0] >= run["seconds"] / 2), None)
    if mid is None or run["seconds"] <= mid[0]:
        return run["source_bytes_done"] / run["seconds"]
    return (run["source_bytes_done"] - mid[1]) / (run["seconds"] - mid[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0, help="convert this long, then stop")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--workers", default="all")
    ap.add_argument("--tmp", default=str(ROOT / "benchmarks"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sparse_checkpoint.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        src, dst = Path(tmp) / "MiniMax-M3-sparse", Path(tmp) / "out"
        t0 = time.time()
        info = build(src)
        info["build_seconds"] = time.time() - t0
        print(f"# {info['files']} shards, {info['tensors']} tensors, {info['logical_bytes'] / 1e9:.1f} GB logical, "
              f"built in {info['build_seconds']:.1f} s", flush=True)
        res = subprocess.run([sys.executable, "-c", RUN.format(root=str(ROOT)), str(src), str(dst), str(args.seconds),
                              args.device, args.workers], capture_output=True, text=True)
        shutil.rmtree(dst, ignore_errors=True)
        lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"child failed ({res.returncode}): {res.stdout[-2000:]} {res.stderr[-3000:]}")
        run = json.loads(lines[-1][7:])
    rate = run["source_bytes_done"] / run["seconds"]
    late = second_half_rate(run)
    result = {"checkpoint": info, "device": args.device, "workers": args.workers, "cores": len(os.sched_getaffinity(0)),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, **run,
              "source_gb_per_s": rate / 1e9, "eta_minutes": info["logical_bytes"] / max(rate, 1) / 60,
              "second_half_gb_per_s": late / 1e9, "eta_minutes_second_half": info["logical_bytes"] / max(late, 1) / 60,
              "estimate_over_measured_peak": run["estimate"] / max(run["peak"]["VmHWM"], 1),
              "stderr_tail": res.stderr[-1500:]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    p = run["peak"]
    print(f"dry run {run['dry_run_seconds']:.1f} s, estimate {run['estimate'] / 1e9:.2f} GB; converted "
          f"{run['source_bytes_done'] / 1e9:.1f} GB in {run['seconds']:.1f} s = {rate / 1e9:.2f} GB/s "
          f"(ETA {result['eta_minutes']:.1f} min for {info['logical_bytes'] / 1e9:.0f} GB; second half "
          f"{late / 1e9:.2f} GB/s, ETA {result['eta_minutes_second_half']:.1f} min); peak anon "
          f"{p['RssAnon'] / 1e9:.2f} GB, file {p['RssFile'] / 1e9:.2f} GB, VmHWM {p['VmHWM'] / 1e9:.2f} GB; "
          f"estimate / VmHWM {result['estimate_over_measured_peak']:.2f}")


if __name__ == "__main__":
    main()
