"""Reference MoE backend: dequantize with porter.format.mxfp8, matmuls per expert. Any device.

Only the experts the tokens were routed to are dequantized. For few routed slots (decode: T*k <= E) the
selected experts are gathered by index and run as one batched matmul, with no host synchronisation, so
a decode step on this backend can be captured in a CUDA graph; otherwise one matmul per used expert.

numerics="serving" computes what FlashInfer's TRT-LLM MXFP8 kernel computes (docs/moe-backends.md,
"Serving numerics"): the layer input and the SwiGLU output (after its clamps) are quantized to MXFP8 with
porter.format.mxfp8.quantize_activations, GEMMs and the weighted sum run in fp32, the result is cast to the input
dtype. It loops over experts (host synchronisation: not capturable in a CUDA graph)."""

from __future__ import annotations

import torch

from porter.format import mxfp8
from runtime.moe.contract import (
    MoeQuantInfo,
    MoeRouting,
    check_numerics,
    route,
    serving_intermediate,
    swiglu_oai,
)


class TorchMoE:
    name = "torch"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        return None  # runs wherever torch runs

    def __init__(self, quant: MoeQuantInfo, routing: MoeRouting, numerics: str = "w8a16"):
        quant.validate()
        check_numerics(numerics, self.name, quant.is_mxfp8)
        self.quant, self.routing, self.numerics = quant, routing, numerics or "w8a16"

    def _expert_weights(self, e, dtype: torch.dtype):
        """e: an expert id -> (w13 [2I, H], w2 [H, I]), or ids [n] -> ([n, 2I, H], [n, H, I]), in dtype."""
        q = self.quant
        if q.is_mxfp8:  # dequantize only the experts asked for: no full-precision copy kept
            w13 = mxfp8.dequantize(q.w13_weight[e], q.w13_weight_scale[e], dtype)  # [(n,) 2I, H]
            w2 = mxfp8.dequantize(q.w2_weight[e], q.w2_weight_scale[e], dtype)  # [(n,) H, I]
        else:
            w13, w2 = q.w13_weight[e].to(dtype), q.w2_weight[e].to(dtype)
        return w13, w2

    def forward_topk(self, hidden_states, topk_ids, topk_weights):
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] (renormalised) -> routed output [T, H],
        routed_scaling_factor applied here, once."""
        serving = self.numerics == "serving"
        # decode sizes, and any call being captured into a CUDA graph (the looped path syncs with the host,
        # which a capture cannot hold): the gathered path
        capturing = topk_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if topk_ids.numel() <= self.quant.num_experts or capturing:
            return self._forward_gathered(hidden_states, topk_ids, topk_weights, serving)
        return self._forward_looped(hidden_states, topk_ids, topk_weights, serving)

    @staticmethod
    def _operands(hidden_states: torch.Tensor, serving: bool) -> tuple[torch.Tensor, torch.dtype]:
        """(the GEMM1 input, the compute dtype): as given in w8a16; serving (W8A8 as the TRT-LLM kernel):
        the MXFP8 input in fp32, the kernel's accumulation precision."""
        if serving:
            return mxfp8.fake_quantize_activations(
                hidden_states, torch.float32, "moe hidden_states"
            ), torch.float32
        return hidden_states, hidden_states.dtype

    def _forward_looped(self, hidden_states, topk_ids, topk_weights, serving: bool = False):
        """One batch per used expert (host sync: the reference for larger calls). serving: MXFP8 input,
        fp32 accumulation, MXFP8 SwiGLU output for GEMM2."""
        q = self.quant
        x, dtype = self._operands(hidden_states, serving)  # [T, H]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        inter = q.intermediate_size
        for e in torch.unique(topk_ids).tolist():
            tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            w13, w2 = self._expert_weights(e, dtype)
            gate_up = x[tok] @ w13.t()  # [n, 2I]
            if q.w13_bias is not None:
                gate_up = gate_up + q.w13_bias[e].to(dtype)
            act = swiglu_oai(
                gate_up[:, :inter],
                gate_up[:, inter:],
                q.gemm1_alpha[e].to(dtype),
                q.gemm1_beta[e].to(dtype),
                q.gemm1_clamp_limit[e].to(dtype),
            )  # [n, I]
            if serving:
                act = serving_intermediate(act)  # the FC1 epilogue's
            y = act @ w2.t()  # [n, H]
            if q.w2_bias is not None:
                y = y + q.w2_bias[e].to(dtype)  # before the routing weight, which scales it too
            # tok holds each token at most once per expert, so a plain indexed add is exact (and, unlike
            # index_add_, not pathologically slow with several CPU threads)
            out[tok] += y.float() * topk_weights[tok, slot].float().unsqueeze(1)
        return (out * self.routing.routed_scaling_factor).to(hidden_states.dtype)

    def _forward_gathered(self, hidden_states, topk_ids, topk_weights, serving: bool = False):
        """Each routed slot (token, j) with its own copy of expert topk_ids[t, j]: [n = T*k] batched.
        serving: _forward_looped's serving math without its host syncs."""
        q = self.quant
        hidden, dtype = self._operands(hidden_states, serving)
        T, k = topk_ids.shape
        ids = topk_ids.reshape(-1)  # [n]
        w13, w2 = self._expert_weights(ids, dtype)  # [n, 2I, H], [n, H, I]
        x = hidden.repeat_interleave(k, dim=0)[:, None]  # [n, 1, H]
        gate_up = torch.bmm(x, w13.transpose(1, 2))[:, 0]  # [n, 2I]
        if q.w13_bias is not None:
            gate_up = gate_up + q.w13_bias[ids].to(dtype)
        inter = q.intermediate_size
        col = lambda t: t[ids].to(dtype)[:, None]  # per-slot parameter, [n, 1]
        act = swiglu_oai(
            gate_up[:, :inter],
            gate_up[:, inter:],
            col(q.gemm1_alpha),
            col(q.gemm1_beta),
            col(q.gemm1_clamp_limit),
        )
        if serving:
            act = serving_intermediate(act)  # the FC1 epilogue's
        y = torch.bmm(act[:, None], w2.transpose(1, 2))[:, 0]  # [n, H]
        if q.w2_bias is not None:
            y = y + q.w2_bias[ids].to(dtype)
        out = (y.float() * topk_weights.reshape(-1, 1).float()).view(T, k, -1).sum(1)  # [T, H]
        return (out * self.routing.routed_scaling_factor).to(hidden_states.dtype)

    def __call__(self, hidden_states):
        topk_ids, topk_weights = route(hidden_states, self.routing)
        return self.forward_topk(hidden_states, topk_ids, topk_weights)
