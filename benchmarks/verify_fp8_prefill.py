"""`porter verify` at MiniMax-M3's real layer dims with and without the Triton backend's FP8 prefill path.

The FP8 prefill path (two e4m3 activation terms, weights rebased to one power-of-two scale per row; see
docs/moe-backends.md) is taken for prompts of T >= triton_backend.FP8_PREFILL_MIN_TOKENS (512) tokens on
SM89+. This builds a synthetic real-dims checkpoint (layer 0 dense, the rest MoE; fewer layers and experts
than the release), converts it, and runs `porter verify --device cuda --backend triton` on one long prompt
twice: PORTER_MOE_FP8=0 (W8A16 prefill) and PORTER_MOE_FP8=1. It prints both verdicts with the logits
KL(ref||conv), top-1 agreement and the worst layer error, so the accuracy cost of FP8 prefill is stated
next to the same check without it.

    python benchmarks/verify_fp8_prefill.py [--layers 3] [--experts 8] [--min-tokens 1100] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import porter  # noqa: E402
from tiny_checkpoint import CORPUS, build_tiny_checkpoint, real_dims_overrides, synthetic_overrides  # noqa: E402

log = logging.getLogger("verify_fp8_prefill")


def long_prompt(src: Path, min_tokens: int) -> tuple[str, int]:
    """Corpus text repeated until the checkpoint's own tokenizer gives at least min_tokens tokens."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    text = CORPUS
    while len(tok.encode(text).ids) < min_tokens:
        text += " " + CORPUS
    return text, len(tok.encode(text).ids)


def run_verify(art: Path, prompt: str, fp8: bool, device: str, backend: str, report: Path) -> dict:
    env = dict(os.environ, PORTER_MOE_FP8="1" if fp8 else "0", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "porter.cli", "verify", str(art), "--device", device, "--backend", backend,
           "--prompt", prompt, "--max-new-tokens", "0", "--report", str(report)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t0
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    rep = json.loads(report.read_text()) if report.is_file() else {}
    return {"fp8_prefill": fp8, "exit_code": proc.returncode, "seconds": round(secs, 1), "report": rep}


def summary(rep: dict) -> dict:
    """The numbers that state the accuracy cost: logits KL/top-1 over the prompt, worst layer error."""
    logits, layers = rep.get("logits") or {}, rep.get("layers") or []
    worst = max((layer["rel_error"] for layer in layers), default=None)
    return {"kl": logits.get("kl"), "top1": logits.get("top1"), "top5": logits.get("top5"),
            "max_abs_logit_diff": logits.get("max_abs_diff"), "positions": logits.get("positions"),
            "worst_layer_rel_error": worst, "min_cosine": min((layer["cosine"] for layer in layers), default=None),
            "passed": rep.get("passed")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=1100, help="prompt length; FP8 prefill starts at "
                    "triton_backend.FP8_PREFILL_MIN_TOKENS")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton", help="MoE backend (the FP8 path exists in triton only)")
    ap.add_argument("--small", action="store_true", help="small synthetic dims (CPU smoke run of this script)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    over = synthetic_overrides(args.layers, 256, 256, args.experts) if args.small else \
        real_dims_overrides(args.layers, args.experts)
    with tempfile.TemporaryDirectory() as tmp:
        src, art = Path(tmp) / "src", Path(tmp) / "art"
        build_tiny_checkpoint(src, text_overrides=over)
        porter.convert(src, art, progress=False, force=True)
        prompt, n_tok = long_prompt(src, args.min_tokens)
        log.info("prompt: %d tokens", n_tok)
        runs = [run_verify(art, prompt, fp8, args.device, args.backend, Path(tmp) / f"report_fp8_{int(fp8)}.json")
                for fp8 in (False, True)]
    result = {"layers": args.layers, "experts": args.experts, "prompt_tokens": n_tok, "small": args.small,
              "runs": [{"fp8_prefill": r["fp8_prefill"], "exit_code": r["exit_code"], "seconds": r["seconds"],
                        **summary(r["report"])} for r in runs]}
    for r in result["runs"]:
        log.info("FP8 prefill %-5s exit %d  KL %s  top-1 %s  worst layer rel err %s  (%.0f s)", r["fp8_prefill"],
                 r["exit_code"], r["kl"], r["top1"], r["worst_layer_rel_error"], r["seconds"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    sys.exit(max(r["exit_code"] for r in runs))


if __name__ == "__main__":
    main()
