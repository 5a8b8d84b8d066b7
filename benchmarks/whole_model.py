"""A whole gpt-oss-20b on one GPU: build, convert, load, generate and verify, each step timed; decode
tokens/s through generate() against the bytes floor of the whole model per token.

1. build: a random gpt-oss-20b at its real config (examples/gpt_oss_tiny_checkpoint.GPT_OSS_20B: 24 layers,
   32 experts top-4, hidden 2880, expert width 2880, 64 q / 8 kv heads of 64, vocab 201088) in OpenAI's
   release layout: MXFP4 experts (`*_blocks` + `*_scales`), bf16 everything else, a word-level tokenizer
   over the whole vocabulary; the random tensors are made on the GPU (or CPU) and written one shard per
   layer into --workdir (default /dev/shm: no disk in the way);
2. convert: `porter.convert` (experts MXFP4 -> MXFP8, exact) on --device;
3. load: `runtime.load` on the GPU;
4. generate: `model.generate(ids, n)` with default arguments (the captured decode step; EOS off), per whole
   token = (time of 1 + n new tokens - time of 1) / n, medians of --reps calls, at each --batches entry.
   Floor = the bytes one decode step reads (every layer's attention weights, norms, sinks and router, the
   experts the step routes to with their scales and biases, the KV slots attended, lm_head, one embedding
   row) / the device copy bandwidth measured in the same run (read + write of 2 GiB);
5. verify: `porter.verify` (integrity, exact bytes, numerics against the MXFP4 source through the same
   runtime), last, so a slow verify never costs the other figures.

Results are written after every step (whole_model_<gpu>.json / .md in --out), so a run stopped early still
reports what it finished.

    python benchmarks/whole_model.py [--workdir /dev/shm/gpt-oss-20b] [--batches 1,8] [--new-tokens 32]
    python benchmarks/whole_model.py --layers 2 --experts 4 --device cpu --tiny   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DEFAULT_OUT, copy_bandwidth, environment, environment_line, markdown_table, write_results  # noqa: E402
from gpt_oss_tiny_checkpoint import GPT_OSS_20B, HARMONY_IDS, word_tokenizer  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import porter  # noqa: E402
import runtime  # noqa: E402

log = logging.getLogger("bench.whole_model")

TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "sliding_window": 8,
}


def model_config(layers: int, experts: int, tiny: bool) -> dict:
    cfg = copy.deepcopy(GPT_OSS_20B) | (TINY_DIMS if tiny else {})
    cfg |= {"num_hidden_layers": layers, "num_local_experts": experts}
    cfg["layer_types"] = (["sliding_attention", "full_attention"] * layers)[:layers]
    cfg["experts_per_token"] = cfg["num_experts_per_tok"] = min(4, experts)
    return cfg


def layer_tensors(cfg: dict, layer: int, g: torch.Generator, dev: str) -> dict:
    """One decoder layer of the release, random: bf16 weights with variance-preserving scales, MXFP4 expert
    blocks of uniformly random codes under scale bytes 2^-8..2^-6 (|w| about 0.02, as 1/sqrt(2880))."""
    h, i, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def lin(n, k):
        return (torch.randn(n, k, device=dev, generator=g) * k**-0.5).bfloat16()

    def vec(n, scale=0.02, mean=0.0):
        return (mean + scale * torch.randn(n, device=dev, generator=g)).bfloat16()

    p = f"model.layers.{layer}."
    t = {
        p + "input_layernorm.weight": vec(h, 0.05, 1.0),
        p + "post_attention_layernorm.weight": vec(h, 0.05, 1.0),
        p + "self_attn.q_proj.weight": lin(nq * d, h),
        p + "self_attn.q_proj.bias": vec(nq * d),
        p + "self_attn.k_proj.weight": lin(nkv * d, h),
        p + "self_attn.k_proj.bias": vec(nkv * d),
        p + "self_attn.v_proj.weight": lin(nkv * d, h),
        p + "self_attn.v_proj.bias": vec(nkv * d),
        p + "self_attn.o_proj.weight": lin(h, nq * d),
        p + "self_attn.o_proj.bias": vec(h),
        p + "self_attn.sinks": vec(nq, 1.0),
        p + "mlp.router.weight": lin(e, h),
        p + "mlp.router.bias": vec(e),
        p + "mlp.experts.gate_up_proj_bias": vec(e * 2 * i).reshape(e, 2 * i),
        p + "mlp.experts.down_proj_bias": vec(e * h).reshape(e, h),
    }
    for name, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
        t[p + f"mlp.experts.{name}_blocks"] = torch.randint(
            0, 256, (e, n, k // 32, 16), dtype=torch.uint8, device=dev, generator=g
        )
        t[p + f"mlp.experts.{name}_scales"] = torch.randint(
            119, 122, (e, n, k // 32), dtype=torch.uint8, device=dev, generator=g
        )
    return t


def build(out: Path, cfg: dict, dev: str, seed: int = 0) -> dict:
    """The release layout into `out`, one shard per layer; -> {"bytes", "seconds", "shards"}."""
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=dev).manual_seed(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    shards = [
        {
            "model.embed_tokens.weight": torch.randn(v, h, device=dev, generator=g).bfloat16(),
            "model.norm.weight": (1 + 0.05 * torch.randn(h, device=dev, generator=g)).bfloat16(),
            "lm_head.weight": (torch.randn(v, h, device=dev, generator=g) * h**-0.5).bfloat16(),
        }
    ]
    shards += [None] * cfg["num_hidden_layers"]
    weight_map, total = {}, 0
    n = len(shards)
    for s in range(n):
        tensors = shards[s] if s == 0 else layer_tensors(cfg, s - 1, g, dev)
        name = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        tensors = {k: t.cpu() for k, t in tensors.items()}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in tensors}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    word_tokenizer(v).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"})
    )
    ids = {k: i for k, i in HARMONY_IDS.items() if i < v}
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [ids.get("<|return|>", 2), ids.get("<|endoftext|>", 1)]})
    )
    return {"bytes": total, "seconds": time.perf_counter() - t0, "shards": n}


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def expert_bytes(cfg) -> int:
    """One routed expert as the artifact stores it: e4m3 w13 [2I, H] and w2 [H, I], one scale byte per 32
    of them, and its biases in fp32 (as the MoE contract holds them)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    values = 2 * i * h + h * i
    return values + values // 32 + 4 * (2 * i + h)


def step_bytes(model, batch: int, slots: int, experts_per_layer: list) -> int:
    """Bytes one decode step reads: per layer its attention weights (+ biases, sinks), norms, router, the
    routed experts' rows (MXFP8 values + scales + biases) and the K/V slots attended (all `slots` on full
    layers, the window on sliding ones); lm_head and one embedding row per sequence."""
    cfg, total = model.cfg, 0
    kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize  # K and V of one slot
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        total += sum(nbytes(lin.weight, lin.scale, lin.bias) for lin in a.linears()) + nbytes(a.sinks)
        total += nbytes(layer.input_layernorm, layer.post_attention_layernorm)
        total += nbytes(layer.mlp.routing.router_weight, layer.mlp.routing.router_bias)
        total += experts_per_layer[i] * expert_bytes(cfg)
        attended = min(slots, cfg.sliding_window) if cfg.is_sliding(i) else slots
        total += batch * attended * kv_row
    return total + nbytes(model.lm_head) + batch * cfg.hidden_size * model.embed_tokens.element_size()


def routed_experts(model, ids: torch.Tensor) -> list:
    """Distinct experts each layer routes the next token of ids to (one eager decode step)."""
    seen = []
    for layer in model.layers:
        moe = layer.mlp

        def record(flat, topk_ids, weights, inner=moe.experts.forward_topk):
            seen.append(int(torch.unique(topk_ids).numel()))
            return inner(flat, topk_ids, weights)

        moe.experts.forward_topk = record
    try:
        cache = model.new_cache(ids.shape[0], ids.shape[1] + 1)
        model(ids, cache)
        seen.clear()
        model(ids[:, -1:], cache)
    finally:
        for layer in model.layers:
            del layer.mlp.experts.forward_topk
    return seen


def generate_ms(model, ids, new: int, reps: int) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        model.generate(ids, new, eos_token_id=[])
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def decode_case(model, batch: int, prompt: int, new: int, reps: int, bw: float) -> dict:
    g = torch.Generator(device=model.device).manual_seed(batch)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), device=model.device, generator=g)
    model.generate(ids, 1, eos_token_id=[])  # warm-up: compilation stays out of `first` (< 0 at reps 1)
    first = generate_ms(model, ids, 1, reps)  # prefill + one token choice
    model.release_decode_state()
    cold = generate_ms(model, ids, 1 + new, 1)  # the first call of this batch / cache size captures
    full = generate_ms(model, ids, 1 + new, reps)
    per_token = (full - first) / new
    slots = model.decode_state[0][1] if model.decode_state is not None else prompt + new + 1
    b = step_bytes(model, batch, slots, routed_experts(model, ids))
    floor = b / bw * 1e3
    return {
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new,
        "ms_per_token": per_token,
        "tokens_per_s": 1e3 / per_token * batch,
        "bytes_per_step": b,
        "floor_ms": floor,
        "x_floor": per_token / floor,
        "cache_slots": slots,
        "first_call_extra_ms": cold - full,
    }


def report(doc: dict, out_dir) -> None:
    env, steps = doc["environment"], doc["steps"]
    lines = [f"# whole gpt-oss-20b ({doc['model']})", "", environment_line(env), ""]
    lines += markdown_table(
        ["step", "seconds", "what"], [[k, f"{v['seconds']:.1f}", v.get("what", "")] for k, v in steps.items()]
    )
    if doc.get("decode"):
        lines += ["", f"copy bandwidth {doc['copy_bandwidth'] / 1e12:.3f} TB/s (read + write of 2 GiB)", ""]
        lines += markdown_table(
            [
                "batch",
                "prompt",
                "ms per token",
                "tokens/s",
                "MB read per step",
                "floor ms",
                "x floor",
                "first call + ms",
            ],
            [
                [
                    r["batch"],
                    r["prompt"],
                    f"{r['ms_per_token']:.3f}",
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['bytes_per_step'] / 1e6:.0f}",
                    f"{r['floor_ms']:.3f}",
                    f"{r['x_floor']:.2f}",
                    f"{r['first_call_extra_ms']:.0f}",
                ]
                for r in doc["decode"]
            ],
        )
    gpu = (env.get("gpu") or "cpu").replace(" ", "_")
    write_results(out_dir, f"whole_model_{gpu}", doc, lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/dev/shm/gpt-oss-20b"))
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="small dims (a CPU smoke run of every step)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-verify", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and artifact in --workdir")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = model_config(args.layers, args.experts, args.tiny)
    src, art = args.workdir / "source", args.workdir / "mxfp8"
    shutil.rmtree(args.workdir, ignore_errors=True)
    doc = {
        "environment": environment(),
        "model": f"{args.layers} layers, {args.experts} experts"
        + (", tiny dims" if args.tiny else ", real dims"),
        "config": cfg,
        "steps": {},
    }
    steps = doc["steps"]
    cuda = args.device.startswith("cuda")
    try:
        info = build(src, cfg, args.device)
        steps["build"] = {**info, "what": f"{info['bytes'] / 1e9:.2f} GB in {info['shards']} shards"}
        report(doc, args.out)
        t = time.perf_counter()
        summary = porter.convert(src, art, device="cuda" if cuda else "cpu", progress=False)
        steps["convert"] = {
            "seconds": time.perf_counter() - t,
            "what": f"{summary['output_bytes'] / 1e9:.2f} GB written "
            f"({summary['device']}, {summary['workers']} workers)",
        }
        report(doc, args.out)
        t = time.perf_counter()
        model = runtime.load(art, device=args.device)
        if cuda:
            torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated() / 1e9 if cuda else float("nan")
        steps["load"] = {"seconds": time.perf_counter() - t, "what": f"{resident:.2f} GB on the GPU"}
        report(doc, args.out)
        doc["copy_bandwidth"] = copy_bandwidth() if cuda else 1e10
        t = time.perf_counter()
        doc["decode"] = []
        for b in (int(x) for x in args.batches.split(",")):
            doc["decode"].append(
                decode_case(model, b, args.prompt_tokens, args.new_tokens, args.reps, doc["copy_bandwidth"])
            )
            report(doc, args.out)
        steps["generate"] = {
            "seconds": time.perf_counter() - t,
            "what": f"batches {args.batches}, {args.new_tokens} tokens, {args.reps} calls each",
        }
        text = model.generate("w1 w2 w3", max_new_tokens=8, chat=False)
        doc["sample"] = text
        del model
        if cuda:
            torch.cuda.empty_cache()
        if not args.skip_verify:
            t = time.perf_counter()
            steps["verify"] = {"seconds": float("nan"), "what": "started"}
            report(doc, args.out)
            rep = porter.verify(art, device=args.device, max_new_tokens=8).report
            doc["verify"] = {
                "verdict": rep.verdict,
                "summary": rep.summary,
                "failures": [str(f) for f in rep.failures],
            }
            lg = rep.logits
            steps["verify"] = {
                "seconds": time.perf_counter() - t,
                "what": f"{rep.verdict}: exact bytes {'identical' if rep.exact and rep.exact.passed else 'DIFFER'}"
                + (f", logits KL {lg.kl:.2e}, top-1 {lg.top1:.1%}" if lg else ""),
            }
        report(doc, args.out)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
