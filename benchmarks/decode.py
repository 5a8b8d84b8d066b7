"""Decode and prefill speed of the runtime at a MiniMax family's real layer dims, against the weight-bytes floor.

Builds a synthetic checkpoint at the real dims with fewer experts and layers (at one token the bytes a layer
reads do not depend on the expert count):
  * --family minimax_m3 (default): H 6144, experts I 3072, shared 3072, dense 12288, 64 q / 4 kv heads,
    head_dim 128, rotary 64, indexer 4 x 128, block 128, top-16 (examples/tiny_checkpoint.py; layer 0 dense);
  * --family minimax_m2: H 3072, 48 q / 8 kv heads of 128, rotary 64, q/k norms over all heads, every layer
    MoE with experts I 1536 top-8, plain SwiGLU, no shared expert, in the release's FP8-block layout
    (examples/minimax_m2_tiny_checkpoint.py);
converts it with porter.convert, loads it on the GPU and times, per layer kind:

  * a decode step (one token per row) replayed from a CUDA graph, at batch 1 with 1k and 8k cached
    tokens, and batch 8 and 32 at 1k; eager (no graph) beside it as the baseline;
  * bytes read = the weights the step touches (attention + indexer + norms, the shared expert and router,
    the routed experts actually selected, or the dense MLP) + KV/index-key cache bytes the attention reads;
    floor = bytes / measured device copy bandwidth (read + write of a 2 GiB buffer);
  * prefill of a 4096-token prompt (eager, per layer).

and projects the full model (M3: 3 dense + 57 MoE layers, M2: 62 MoE layers, + lm_head at vocab 200064) in
tokens/s (M3: next to the published figures). Writes decode_<gpu>.json and .md (M2: decode_minimax_m2_<gpu>)
to --out. --device cpu --tiny runs every step at the fixtures' tiny dims on the CPU (wall-clock timings, no
CUDA graphs or kernel profiles): a smoke run.

    python benchmarks/decode.py --layers 2 --experts 8 [--workdir /tmp/m3-decode] [--out DIR]
    python benchmarks/decode.py --family minimax_m2 --layers 4 --experts 16 --scopes experts
    python benchmarks/decode.py --family minimax_m2 --device cpu --tiny --cases 1x64,2x64 --prefill-tokens 32
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    DEFAULT_OUT,
    REAL_VOCAB,
    build_checkpoint,
    copy_bandwidth,
    environment,
    environment_line,
    mean_ms,
    write_results,
)
from minimax_m2_tiny_checkpoint import build_m2_checkpoint  # noqa: E402
from tiny_checkpoint import build_tiny_checkpoint, real_dims_overrides, synthetic_overrides  # noqa: E402

import porter  # noqa: E402
import runtime  # noqa: E402
from runtime.cache import Step  # noqa: E402
from runtime.graph import DecodeGraph  # noqa: E402
from runtime.models import minimax_m2, minimax_m3  # noqa: E402
from runtime.models.layers import rms_norm  # noqa: E402
from runtime.moe.contract import route  # noqa: E402

log = logging.getLogger("bench.decode")

FULL_VOCAB = REAL_VOCAB  # both families' vocab_size (docs/minimax-m3.md, docs/minimax-m2.md)
CASES = [(1, 1024), (1, 8192), (8, 1024), (32, 1024)]  # (batch, cached tokens)
MOE_BLOCKS = (minimax_m3.MoE, minimax_m2.MoE)


@dataclass(frozen=True)
class Family:
    """What the benchmark needs of a family: the real model's layer counts and experts, how the synthetic
    checkpoint is laid out (for the tables), the layers / KV sizes of the kernel profiles."""

    title: str  # the markdown title
    stem: str  # result files: <stem><gpu>.json / .md
    dense: int  # the real model's dense-MLP layers
    moe: int  # ... and MoE layers
    experts: int  # the real model's routed experts
    top_k: int
    synthetic: str  # "{n} layers (...), {e} experts top-k": how the checkpoint's layers are laid out
    workdir: str
    profiles: tuple  # (layer, KV) of the batch-1 kernel profiles
    published: dict  # published whole-model figures, name -> tok/s

    @property
    def projected(self) -> str:
        """The projection's layers, e.g. "3 dense + 57 MoE"."""
        return f"{self.dense} dense + {self.moe} MoE" if self.dense else f"{self.moe} MoE"


FAMILIES = {
    "minimax_m3": Family(
        "Decode at real dims",
        "decode_",
        3,
        57,
        128,
        4,
        "(layer 0 dense attention + dense MLP, the rest sparse attention + MoE)",
        "/tmp/m3-decode",
        ((0, 1024), (1, 1024), (1, 8192)),
        {"sglang, GB300, TP4 (tok/s)": 158, "vLLM Marlin, H200 (tok/s per GPU)": 113},
    ),
    "minimax_m2": Family(
        "MiniMax-M2 decode at real dims",
        "decode_minimax_m2_",
        0,
        62,
        256,
        8,
        "(every layer dense attention + MoE, as the real model; the release's FP8-block source layout)",
        "/tmp/m2-decode",
        ((0, 1024), (0, 8192)),
        {},
    ),
}


def is_moe(layer) -> bool:
    return isinstance(layer.mlp, MOE_BLOCKS)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, iters: int = 50, graph: bool = True) -> float:
    """Mean ms per call: on CUDA common.mean_ms (graph=True: CUDA-graph replay); on the CPU wall time of
    eager calls after one warm-up (the smoke run)."""
    if device.type == "cuda":
        return mean_ms(fn, iters=iters, graph=graph)
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def copy_rate(device: torch.device) -> float:
    """Bytes/s of a device copy (read + write): common.copy_bandwidth on CUDA, a 256 MiB copy on the CPU."""
    if device.type == "cuda":
        return copy_bandwidth()
    x = torch.empty(256 << 20, dtype=torch.uint8)
    y = torch.empty_like(x)
    return 2 * x.numel() / (timed(lambda: y.copy_(x), device, iters=5) / 1e3)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def linear_bytes(lin) -> int:
    return nbytes(lin.weight, lin.scale)


def attention_bytes(layer) -> int:
    a = layer.self_attn
    b = sum(linear_bytes(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)) + nbytes(
        a.q_norm, a.k_norm, layer.input_layernorm, layer.post_attention_layernorm
    )
    if getattr(a, "indexer", None) is not None:
        b += (
            linear_bytes(a.indexer.q_proj)
            + linear_bytes(a.indexer.k_proj)
            + nbytes(a.indexer.q_norm, a.indexer.k_norm)
        )
    return b


def mlp_bytes(layer, experts_touched: int) -> int:
    m = layer.mlp
    if not is_moe(layer):
        return linear_bytes(m.gate_proj) + linear_bytes(m.up_proj) + linear_bytes(m.down_proj)
    if m.quant is not None:
        q = m.quant
        per_expert = nbytes(q.w13_weight[0], q.w13_weight_scale[0], q.w2_weight[0], q.w2_weight_scale[0])
    else:  # the Triton backend's own layout (rebased at load: e4m3 + one fp32 scale per row)
        p = m.experts.prepared
        per_expert = nbytes(p.w13[0], p.w13_scale[0], p.w2[0], p.w2_scale[0])
    s = getattr(m, "shared_experts", None)  # M2 has none
    shared = (
        0 if s is None else linear_bytes(s.gate_proj) + linear_bytes(s.up_proj) + linear_bytes(s.down_proj)
    )
    return (
        experts_touched * per_expert
        + shared
        + nbytes(m.routing.router_weight, m.routing.e_score_correction_bias)
    )


def cache_bytes(cfg, layer, batch: int, kv: int) -> int:
    """K/V (and index keys) the decode attention reads: dense all kv slots, sparse top-k blocks."""
    per_tok = cfg.num_key_value_heads * cfg.head_dim * 2 * 2  # K and V, bf16
    if getattr(layer.self_attn, "indexer", None) is None:
        return batch * kv * per_tok
    sel = min(kv + 1, cfg.index_topk_blocks * cfg.index_block_size)
    return batch * (sel * per_tok + kv * cfg.index_head_dim * 2)


def filled_cache(model, batch: int, kv: int, extra: int = 128):
    cache = model.new_cache(batch, kv + extra)
    g = torch.Generator(device=model.device).manual_seed(0)
    for lc in cache.layers:
        for t in (lc.k, lc.v, lc.idx_k):
            if t is not None:
                t.normal_(generator=g)
    cache.length = kv
    cache.next_pos.fill_(kv)
    return cache


def experts_touched(layer, h: torch.Tensor) -> int:
    if not is_moe(layer):
        return 0
    x = rms_norm(h, layer.post_attention_layernorm, layer.eps).reshape(
        -1, h.shape[-1]
    )  # approximation: pre-attention h
    ids, _ = route(x, layer.mlp.routing)
    return int(torch.unique(ids).numel())


@torch.inference_mode()
def decode_case(model, batch: int, kv: int, bw: float) -> dict:
    cfg, dev = model.cfg, model.device
    cache = filled_cache(model, batch, kv)
    g = torch.Generator(device=dev).manual_seed(1)
    h = torch.randn(batch, 1, cfg.hidden_size, device=dev, dtype=model.dtype, generator=g)
    step = Step(cache.next_pos[:, None].clone(), None, cache.max_len, decode=True)
    rows = []
    for i, layer in enumerate(model.layers):
        lc = cache.layers[i]
        eager = timed(lambda: layer(h, step, lc), dev, iters=10, graph=False)
        try:
            ms = timed(lambda: layer(h, step, lc), dev) if dev.type == "cuda" else eager
        except RuntimeError as e:  # report and go on with the eager figure
            log.warning("layer %d: CUDA-graph capture failed (%s); ms = eager", i, str(e).splitlines()[0])
            ms = eager
            sync(dev)
        touched = experts_touched(layer, h)
        b = attention_bytes(layer) + mlp_bytes(layer, touched) + cache_bytes(cfg, layer, batch, kv)
        floor = b / bw * 1e3
        row = {
            "layer": i,
            "kind": "moe" if is_moe(layer) else "dense",
            "ms": ms,
            "eager_ms": eager,
            "bytes": b,
            "experts_touched": touched,
            "floor_ms": floor,
            "x_floor": ms / floor,
        }
        rows.append(row)
    tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
    graph = lambda t: model(t, cache)  # noqa: E731  (eager steps: the CPU, or no capture)
    try:
        if dev.type == "cuda":
            graph = DecodeGraph(model, cache)
            graph(tok)  # capture
    except RuntimeError as e:
        log.warning("whole-step CUDA graph failed (%s); timing eager steps", str(e).splitlines()[0])
        graph = lambda t: model(t, cache)  # noqa: E731
    sync(dev)
    start = time.perf_counter()
    n = 20
    for _ in range(n):
        graph(tok)
    sync(dev)
    step_ms = (time.perf_counter() - start) / n * 1e3
    return {"batch": batch, "kv": kv, "layers": rows, "model_step_ms": step_ms}


def generate_ms(model, ids: torch.Tensor, new: int, reps: int = 3) -> float:
    """Median wall time of model.generate(ids, new) as a user calls it (defaults: the captured decode step
    on CUDA), EOS off so every row runs to `new` tokens."""
    times = []
    for _ in range(reps):
        sync(model.device)
        t = time.perf_counter()
        model.generate(ids, new, eos_token_id=[])
        sync(model.device)
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def whole_token_case(model, batch: int, kv: int, bw: float, layer_rows: list, new: int = 32) -> dict:
    """Per whole token through the public generate(): (generate(1 + new) - generate(1)) / new, i.e. every
    layer, the final norm, lm_head at the checkpoint's vocab and the token choice, next to the bytes floor
    of that step (the layers' weights and cache reads at this KV, plus lm_head)."""
    g = torch.Generator(device=model.device).manual_seed(2)
    ids = torch.randint(0, min(1000, model.cfg.vocab_size), (batch, kv), device=model.device, generator=g)
    first = generate_ms(model, ids, 1, reps=5)  # prefill only (its kernels compiled by the first repeat)
    model.release_decode_state()
    cold = generate_ms(model, ids, 1 + new, reps=1)  # the first call of this batch / cache size captures
    full = generate_ms(model, ids, 1 + new, reps=5)  # later calls replay the step the first one captured
    per_token = (full - first) / new
    head = nbytes(model.lm_head) + model.cfg.hidden_size * 2  # lm_head + one embedding row
    b = sum(r["bytes"] for r in layer_rows) + head
    floor = b / bw * 1e3
    return {
        "batch": batch,
        "kv": kv,
        "new_tokens": new,
        "ms_per_token": per_token,
        "bytes": b,
        "floor_ms": floor,
        "x_floor": per_token / floor,
        "tokens_per_s": 1e3 / per_token * batch,
        "first_call_extra_ms": cold - full,
    }


@torch.inference_mode()
def kernel_profile(model, layer_index: int, kv: int = 1024, replays: int = 10) -> dict:
    """Kernels of one decode step of a layer as the CUDA graph replays it (batch 1): each kernel's mean
    device time in the first replay's start order, their count and sum (no gaps; kernels that overlap on
    the two streams are each counted whole)."""
    from torch.profiler import ProfilerActivity, profile

    cache = filled_cache(model, 1, kv)
    h = torch.randn(1, 1, model.cfg.hidden_size, device="cuda", dtype=model.dtype)
    step = Step(cache.next_pos[:, None].clone(), None, cache.max_len, decode=True)
    layer, lc = model.layers[layer_index], cache.layers[layer_index]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(h, step, lc)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        layer(h, step, lc)
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )
    per_step = len(events) // replays
    # Kernels on the shared expert's stream interleave with the main stream's in a different order from one
    # replay to the next, so a kernel is known by (name, its n-th launch of that name in the replay)
    times: dict = {}
    for r in range(replays):
        seen: dict = {}
        for e in events[r * per_step : (r + 1) * per_step]:
            n = seen[e.name] = seen.get(e.name, 0) + 1
            times.setdefault((e.name, n), []).append(e.device_time_total)
    kernels = [(name[:80], round(sum(ts) / len(ts), 2)) for (name, _), ts in times.items()]
    return {
        "layer": layer_index,
        "kv": kv,
        "kernels": per_step,
        "busy_ms": sum(us for _, us in kernels) / 1e3,
        "list_us": kernels,
    }


@torch.inference_mode()
def lm_head_ms(batch: int, hidden: int, device: torch.device) -> float:
    w = torch.randn(FULL_VOCAB, hidden, device=device, dtype=torch.bfloat16)
    x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
    return timed(lambda: torch.nn.functional.linear(x, w), device, iters=50 if device.type == "cuda" else 3)


@torch.inference_mode()
def prefill(model, tokens: int) -> dict:
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), device=model.device)
    step = model.make_step(1, tokens, None)
    h0 = model.embed(ids)
    rows = []
    for i, layer in enumerate(model.layers):
        layer(h0, step)  # warm-up (compiles kernels for this shape)
        ms = timed(lambda: layer(h0, step), model.device, iters=3, graph=False)
        rows.append({"layer": i, "kind": "moe" if is_moe(layer) else "dense", "ms": ms})
    return {"tokens": tokens, "layers": rows}


def full_model(fam: Family, rows: list, key: str) -> float:
    """rows' `key` summed over the real model's layers: each kind's mean here times its count there."""
    total = 0.0
    for kind, count in (("dense", fam.dense), ("moe", fam.moe)):
        v = [r[key] for r in rows if r["kind"] == kind]
        total += count * sum(v) / len(v) if count else 0.0
    return total


def project(fam: Family, rows: list, head_ms: float) -> dict:
    step = full_model(fam, rows, "ms") + head_ms
    return {"step_ms": step, "tokens_per_s": 1e3 / step, "floor_layers_ms": full_model(fam, rows, "floor_ms")}


def build_source(family: str, src: Path, layers: int, experts: int, tiny: bool) -> None:
    """The synthetic checkpoint: the family's real layer dims (tiny: the test fixtures' dims), `layers`
    layers of `experts` experts, vocab 200064 (tiny: the fixture's tokenizer's), room for 8k-token caches."""
    t = time.time()
    if family == "minimax_m3":
        dims = synthetic_overrides(layers, hidden=256, intermediate=128, experts=experts) if tiny else None
        overrides = (dims or real_dims_overrides(layers, experts)) | {"max_position_embeddings": 65536}
        if not tiny:
            overrides["vocab_size"] = FULL_VOCAB
        build_tiny_checkpoint(src, layout="vendor", seed=0, text_overrides=overrides)
    elif tiny:
        build_m2_checkpoint(
            src,
            "fp8",
            overrides={
                "num_hidden_layers": layers,
                "num_local_experts": experts,
                "num_experts_per_tok": min(8, experts),
                "num_mtp_modules": 0,
            },
        )
    else:  # the real config's context (196608 positions): generate checks prompt + new tokens against it
        build_checkpoint(src, layers, experts, FULL_VOCAB, "m2-fp8", {"max_position_embeddings": 196608})
    log.info("built %s checkpoint in %.0f s", "tiny" if tiny else "real-dims", time.time() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="minimax_m3")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the test fixtures' tiny dims (a CPU smoke run)")
    ap.add_argument("--workdir", default=None, help="default /tmp/m3-decode or /tmp/m2-decode")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder for decode_<gpu>.json and .md")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--scopes", default="experts,all", help="porter convert --quantize scopes to measure")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="0: no prefill figure")
    ap.add_argument(
        "--cases",
        default=",".join(f"{b}x{kv}" for b, kv in CASES),
        help="BATCHxKV decode cases of the first scope (the others: batch 1 only)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fam, dev = FAMILIES[args.family], torch.device(args.device)
    work = Path(args.workdir or fam.workdir)
    src = work / "src"
    if not (src / "model.safetensors.index.json").exists():
        build_source(args.family, src, args.layers, args.experts, args.tiny)
    bw = copy_rate(dev)
    env = environment()
    gpu = env["gpu"] if dev.type == "cuda" else "cpu"
    doc = {
        **env,
        "family": args.family,
        "copy_bandwidth_TBps": bw / 1e12,
        "layers": args.layers,
        "experts": args.experts,
        "scopes": {},
    }
    lines = [
        f"# {fam.title} — {gpu}",
        "",
        environment_line(env) + ".",
        "",
        "Measured copy bandwidth "
        f"{bw / 1e12:.2f} TB/s (floor = bytes / that). Synthetic checkpoint: {args.layers} layers "
        f"{fam.synthetic}, {args.experts} experts "
        f"top-{min(fam.top_k, args.experts)}, {'tiny' if args.tiny else 'real'} layer dims. "
        + (
            "ms = CUDA-graph replay of one layer's decode step; eager = the same step launched kernel by kernel."
            if dev.type == "cuda"
            else "ms = eager = wall time of one layer's decode step on the CPU (no CUDA graph)."
        ),
        "",
    ]
    scopes = args.scopes.split(",")
    for scope in scopes:
        art = work / f"mxfp8-{scope}"
        if not (art / "model.safetensors.index.json").exists():
            t = time.time()
            porter.convert(src, art, quantize=scope, progress=False, force=True)
            log.info("converted (--quantize %s) in %.0f s", scope, time.time() - t)
        model = runtime.load(art, device=args.device, backend="auto")
        res = {"decode": [], "prefill": None}
        lines += [
            f"## --quantize {scope}",
            "",
            "| batch | KV | layer | kind | ms | eager ms | MB read | floor ms | x floor |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
        if scope != scopes[0]:
            cases = [c for c in cases if c[0] == 1]  # the other scopes: batch 1 only
        whole = []
        for batch, kv in cases:
            case = decode_case(model, batch, kv, bw)
            head = lm_head_ms(batch, model.cfg.hidden_size, dev)
            case["lm_head_ms"] = head
            case["projection"] = project(fam, case["layers"], head)
            case["whole_token"] = w = whole_token_case(model, batch, kv, bw, case["layers"])
            whole.append(w)
            log.info(
                "quantize=%s B=%d KV=%d: generate() %.3f ms per whole token (%d layers + lm_head at vocab "
                "%d), floor %.3f ms, %.2fx floor, %.0f tokens/s; first call +%.1f ms (capture)",
                scope,
                batch,
                kv,
                w["ms_per_token"],
                args.layers,
                model.cfg.vocab_size,
                w["floor_ms"],
                w["x_floor"],
                w["tokens_per_s"],
                w["first_call_extra_ms"],
            )
            res["decode"].append(case)
            for r in case["layers"]:
                lines.append(
                    f"| {batch} | {kv} | {r['layer']} | {r['kind']} | {r['ms']:.3f} | {r['eager_ms']:.3f} | "
                    f"{r['bytes'] / 1e6:.1f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} |"
                )
                log.info(
                    "quantize=%s B=%d KV=%d layer %d (%s): %.3f ms (eager %.3f), %.1f MB, floor %.3f ms, "
                    "%.2fx floor",
                    scope,
                    batch,
                    kv,
                    r["layer"],
                    r["kind"],
                    r["ms"],
                    r["eager_ms"],
                    r["bytes"] / 1e6,
                    r["floor_ms"],
                    r["x_floor"],
                )
            p = case["projection"]
            log.info(
                "quantize=%s B=%d KV=%d: whole %d-layer step (DecodeGraph) %.3f ms; projected %d layers + "
                "lm_head %.2f ms -> %.1f tok/s per sequence (%.1f tok/s total)",
                scope,
                batch,
                kv,
                args.layers,
                case["model_step_ms"],
                fam.dense + fam.moe,
                p["step_ms"],
                p["tokens_per_s"],
                p["tokens_per_s"] * batch,
            )
        lines += [
            "",
            f"Whole token through `model.generate(ids, n)` with default arguments (EOS off), "
            f"{args.layers} layers + lm_head at vocab {model.cfg.vocab_size}: "
            "(time of 33 new tokens - time of 1) / 32.",
            "",
            "| batch | KV | ms per token | MB read per step | floor ms | x floor | tokens/s | "
            "first call + ms (capture) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {w['batch']} | {w['kv']} | {w['ms_per_token']:.3f} | {w['bytes'] / 1e6:.0f} | "
            f"{w['floor_ms']:.3f} | {w['x_floor']:.2f} | {w['tokens_per_s']:.0f} | "
            f"{w['first_call_extra_ms']:.1f} |"
            for w in whole
        ]
        lines += [
            "",
            f"| batch | KV | projected step ms ({fam.projected} + lm_head) | tok/s per sequence | "
            "tok/s total | layers' floor ms |",
            "|---|---|---|---|---|---|",
        ]
        for c in res["decode"]:
            p = c["projection"]
            lines.append(
                f"| {c['batch']} | {c['kv']} | {p['step_ms']:.2f} | {p['tokens_per_s']:.1f} | "
                f"{p['tokens_per_s'] * c['batch']:.1f} | {p['floor_layers_ms']:.2f} |"
            )
        published = "; ".join(f"{k}: {v}" for k, v in fam.published.items())
        lines += [
            "",
            (f"Published: {published}. " if published else "")
            + "Batch > 1 rows read the experts this small model's router touched (at most "
            f"{args.experts}); the real {fam.experts}-expert model touches more.",
            "",
        ]
        for li, kv in fam.profiles if dev.type == "cuda" else ():
            try:
                prof = kernel_profile(model, li, kv)
            except Exception as e:  # the profile is a diagnostic: report and go on
                log.warning("profile failed: %s", str(e).splitlines()[0])
                break
            res.setdefault("profile", []).append(prof)
            log.info(
                "quantize=%s layer %d decode step (graph replay, batch 1, KV %d): %d kernels, %.3f ms of "
                "kernel time: %s",
                scope,
                li,
                kv,
                prof["kernels"],
                prof["busy_ms"],
                prof["list_us"],
            )
            lines.append(
                f"Layer {li}, batch 1, KV {kv // 1024}k, CUDA-graph replay: {prof['kernels']} kernels, "
                f"{prof['busy_ms']:.3f} ms summed kernel time (the shared expert's kernels run concurrently "
                "with the router's and routed experts', so the sum exceeds the step): "
                + ", ".join(f"{n} {us:.1f}" for n, us in prof["list_us"])
                + " (us)."
            )
        lines.append("")
        if args.prefill_tokens and scope == scopes[0]:
            pf = prefill(model, args.prefill_tokens)
            res["prefill"] = pf
            full = full_model(fam, pf["layers"], "ms")
            pf["projected_full_ms"], pf["projected_tokens_per_s"] = full, args.prefill_tokens / full * 1e3
            lines += [
                f"Prefill {args.prefill_tokens} tokens (batch 1, eager): "
                + ", ".join(f"layer {r['layer']} ({r['kind']}) {r['ms']:.1f} ms" for r in pf["layers"])
                + f"; projected {fam.dense + fam.moe} layers {full:.0f} ms = "
                f"{pf['projected_tokens_per_s']:.0f} tokens/s "
                f"(routed experts: {args.experts} here vs {fam.experts}, same FLOPs per token).",
                "",
            ]
            log.info(
                "quantize=%s prefill %d tokens: %s; projected %.0f tokens/s",
                scope,
                args.prefill_tokens,
                [round(r["ms"], 1) for r in pf["layers"]],
                pf["projected_tokens_per_s"],
            )
        doc["scopes"][scope] = res
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    write_results(args.out, fam.stem + gpu.replace(" ", "_"), doc, lines)


if __name__ == "__main__":
    main()
