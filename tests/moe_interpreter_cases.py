"""The Triton MoE kernels against the torch reference in Triton's CPU interpreter (TRITON_INTERPRET=1), at tiny
dims: MiniMax-M2's shape of layer (top-8, plain SwiGLU as alpha 1 / beta 0 / limit inf) and gpt-oss's
(SwiGLU-OAI with per-expert biases). Run as a script by tests/test_triton_moe.py in a child process, because
the interpreter must be switched on before the kernels module is imported; prints one JSON object per case.

Not run: the fused one-token output (its fence is inline PTX, which the interpreter cannot run) and the
bf16 GEMM2 (the interpreter's bf16 dot is wrong: checked on the H200 by the gpu tests instead).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from porter.format import mxfp8
from runtime.moe.contract import MoeQuantInfo, MoeRouting, make_swiglu_params
from runtime.moe.torch_backend import TorchMoE
from runtime.moe.triton import launch
from runtime.moe.triton import prepare as tp

E, H, I = 16, 128, 64  # [E, 2I, H] / [E, H, I]: two GEMM1 tiles (BN 32), two GEMM2 tiles (BN 64)
# (name, top_k, (alpha, beta, limit), biases, tokens, x scale, rebase at load)
CASES = [
    ("m2 plain", 8, (1.0, 0.0, math.inf), False, 1, 1.0, True),
    ("m2 plain", 8, (1.0, 0.0, math.inf), False, 3, 1.0, True),
    ("m2 plain", 8, (1.0, 0.0, math.inf), False, 12, 1.0, True),
    ("m2 plain, act past fp16", 8, (1.0, 0.0, math.inf), False, 1, 1e3, True),
    ("m2 plain, act past fp16", 8, (1.0, 0.0, math.inf), False, 12, 1e3, True),
    ("m2 plain, stored", 8, (1.0, 0.0, math.inf), False, 1, 1e3, False),
    ("m2 plain, stored", 8, (1.0, 0.0, math.inf), False, 3, 1.0, False),
    ("gpt-oss biases", 4, (1.702, 1.0, 7.0), True, 1, 1.0, True),
    ("gpt-oss biases", 4, (1.702, 1.0, 7.0), True, 5, 1.0, True),
    ("gpt-oss biases, stored", 4, (1.702, 1.0, 7.0), True, 12, 1.0, False),
    ("plain + biases, act past fp16", 8, (1.0, 0.0, math.inf), True, 3, 1e3, True),
]


def run_case(name, k, swiglu, biases, t, x_scale, rebase, gen):
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.03
    w2 = torch.randn(E, H, I, generator=gen) * 0.03
    q13, s13 = mxfp8.quantize(w13)
    q2, s2 = mxfp8.quantize(w2)
    bias = dict(w13_bias=torch.randn(E, 2 * I, generator=gen), w2_bias=torch.randn(E, H, generator=gen) * 0.1)
    quant = MoeQuantInfo(
        q13, s13, q2, s2, **make_swiglu_params(E, *swiglu, "cpu"), **(bias if biases else {})
    )
    x = (torch.randn(t, H, generator=gen) * x_scale).to(torch.bfloat16)
    ids = torch.rand(t, E, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(t, k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    rsf = 2.5
    ref = TorchMoE(quant, MoeRouting(torch.zeros(E, H), torch.zeros(E), k, rsf)).forward_topk(
        x.float(), ids, w
    )
    swiglu_t = (quant.gemm1_alpha, quant.gemm1_beta, quant.gemm1_clamp_limit)
    p = tp.prepare(q13, s13, q2, s2, *swiglu_t, quant.w13_bias, quant.w2_bias, rebase=rebase)
    out = launch.fused_moe(p, x, ids, w, rsf, fused_out=False).float()
    no_bias = None
    if biases:  # the same layer without its biases: how far the biases move the output
        p0 = tp.prepare(q13, s13, q2, s2, *swiglu_t, rebase=rebase)
        no_bias = float(
            (launch.fused_moe(p0, x, ids, w, rsf, fused_out=False).float() - ref).norm() / ref.norm()
        )
    return {
        "case": name,
        "T": t,
        "rebased": p.rebased,
        "act_scaled": p.act_bound is not None,
        "nosort": launch.plan(p, t, k, H, None, None, False, True, x.device).nosort,
        "finite": bool(torch.isfinite(out).all()),
        "act_max": largest_act(quant, x.float(), ids),
        "rel_err": float((out - ref).norm() / ref.norm()),
        "rel_without_biases": no_bias,
    }


def largest_act(quant, x, ids) -> float:
    """max |SwiGLU-OAI output| over the routed (token, expert) pairs, in fp32 on the MXFP8 weights."""
    from runtime.moe.contract import swiglu_oai

    inter, top = quant.intermediate_size, 0.0
    for tok, e in zip(
        *[v.flatten().tolist() for v in (torch.arange(ids.shape[0])[:, None].expand_as(ids), ids)]
    ):
        gu = mxfp8.dequantize(quant.w13_weight[e], quant.w13_weight_scale[e]) @ x[tok]  # [2I]
        if quant.w13_bias is not None:
            gu = gu + quant.w13_bias[e]
        a, b, lim = (float(v[e]) for v in (quant.gemm1_alpha, quant.gemm1_beta, quant.gemm1_clamp_limit))
        top = max(top, float(swiglu_oai(gu[:inter], gu[inter:], a, b, lim).abs().max()))
    return top


def numpy_scalar_index_shim() -> None:
    """Triton's interpreter (3.6, for one) converts a scalar kernel argument with int() of its 1-element array,
    which numpy 2.4 refuses ("only 0-dimensional arrays can be converted"), so `range(0, K, BK)` over a runtime
    K fails. Where this numpy refuses it, the interpreter reads the one element instead (this script only)."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def main():
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (Triton's CPU interpreter)")
    numpy_scalar_index_shim()
    gen = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    for case in CASES:
        print(json.dumps(run_case(*case, gen)), flush=True)


if __name__ == "__main__":
    main()
