"""Why the fused output (last arriver per (token, N tile) writes the row tile) goes wrong with several tokens
on the NOSORT path: many calls at MiniMax-M3 dims (H 6144, I 3072, 8 experts top-4, so experts are shared
between tokens), each against the unfused path; for every wrong (token, N tile) it reports which subset of the
token's routed slots the written tile equals (from each slot's contribution alone), and whether the scratch and
counters are left zero. PDL on and off. The per-element count ("off by more than one bf16 step") has no
absolute floor, so near-zero elements whose fp32 sum order moves them count too (the worst call's relative
error tells those apart); a tile off by more than 1e-3 of its norm is the race's signature.
  python3 benchmarks/fused_out_race.py [--tokens 2,3,4] [--calls 200]"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moe_layer import H, RSF, TOPK, prepare_quant, random_quant  # noqa: E402
from runtime.moe import triton_backend as tb  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2,3,4")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--layouts", default="rebased", help="rebased,stored: the experts rebased at load or as stored")
    args = ap.parse_args()
    dev = torch.device("cuda")
    e, h, k = 8, H, TOPK
    quant = random_quant(dev, e, sigma=0.03)
    bn = tb.default_config(1).bn2
    for layout, t in itertools.product(args.layouts.split(","), [int(v) for v in args.tokens.split(",")]):
        tb.REBASE_AT_LOAD = layout == "rebased"
        p = prepare_quant(quant)
        tb.REBASE_AT_LOAD = None
        x = torch.randn(t, h, device=dev).to(torch.bfloat16)
        ids = torch.rand(t, e, device=dev).topk(k, dim=-1).indices
        w = torch.rand(t, k, device=dev) + 0.1
        base = tb.fused_moe(p, x, ids, w, RSF, nosort=True, fused_out=False).float()
        parts = []  # [k] of [t, h]: each slot's contribution alone
        for s in range(k):
            ws = torch.zeros_like(w)
            ws[:, s] = w[:, s]
            parts.append(tb.fused_moe(p, x, ids, ws, RSF, nosort=True, fused_out=False).float())
        for pdl in (True, False):
            tb.USE_PDL = pdl
            outs = torch.stack([tb.fused_moe(p, x, ids, w, RSF, nosort=True, fused_out=True).float()
                                for _ in range(args.calls)])  # [calls, t, h]
            torch.cuda.synchronize()
            tb.USE_PDL = None
            scratch, counts = tb._fused_out_scratch(dev, h)
            tiles = (outs - base).reshape(args.calls, t, h // bn, bn)
            bad = (tiles.norm(dim=-1) > 1e-3 * base.reshape(t, h // bn, bn).norm(dim=-1).clamp_min(1e-30))
            nbad_calls = int(bad.flatten(1).any(1).sum())
            # fp32 add order alone moves an element by at most one bf16 rounding step (2^-8 of its magnitude)
            ulp_off = int(((outs - base).abs() > base.abs() * 2.0 ** -8 + 1e-30).flatten(1).any(1).sum())
            worst = float(((outs - base).flatten(1).norm(dim=1) / base.norm()).max())
            print(f"{layout} T={t} PDL={pdl}: {ulp_off} of {args.calls} calls with an element off by more than one "
                  f"bf16 step (worst call rel {worst:.1e}); {nbad_calls} calls with a tile off by > 1e-3, "
                  f"{int(bad.sum())} such tiles; "
                  f"scratch nonzero {int(scratch.ne(0).sum())}, counters nonzero {int(counts.ne(0).sum())} "
                  f"(max {int(counts.max())})", flush=True)
            for c, tok, j in bad.nonzero().tolist()[:4]:
                got = outs[c, tok, j * bn:(j + 1) * bn]
                best = None
                for r in range(k + 1):
                    for sub in itertools.combinations(range(k), r):
                        ref = sum((parts[s][tok, j * bn:(j + 1) * bn] for s in sub), torch.zeros_like(got))
                        err = float((got - ref).norm() / got.norm().clamp_min(1e-30)) if got.norm() > 0 else float(ref.norm())
                        if best is None or err < best[0]:
                            best = (err, sub)
                print(f"  call {c} token {tok} tile {j}: |got| {float(got.norm()):.3e} |want| "
                      f"{float(base[tok, j * bn:(j + 1) * bn].norm()):.3e}; closest slot subset {best[1]} "
                      f"(rel {best[0]:.1e}); experts {ids[tok].tolist()}", flush=True)
            scratch.zero_()
            counts.zero_()


if __name__ == "__main__":
    main()
