"""Blackwell MoE backend: FlashInfer's TRT-LLM FP8 block-scale MoE in MxFp8 mode (SM100/103/107 only).

Contract and upstream sources: docs/moe-backends.md (FlashInfer TRT-LLM section); kernel API as in
flashinfer-python 0.7.2.post1 (flashinfer/fused_moe/core.py, prepare.py). flashinfer is imported
lazily, inside functions, so that importing this module (or running the CPU/Hopper paths) never loads it.

Load time (`TrtllmMoE.__init__`, pure functions `prepare_w13` / `prepare_w2`), per expert:
  w13 [gate; up] -> [up; gate] (gemm1's row order) -> gated-act row interleave -> shuffle_matrix_a rows
  (tile 128); w13 scales: the same row permutation, then the 128x4 swizzle;
  w2 and its scales: the shuffle_matrix_a row permutation; scales then 128x4-swizzled;
  expert biases (fp32, optional): the same row permutations as their weights (`prepare_biases`).
All row work is one gather with an index composed from flashinfer's own pure-torch index functions.
flashinfer's swizzle (`block_scale_interleave`) only accepts CUDA tensors, so `swizzle_scales_128x4`
is a torch equivalent that runs on any device (tests prove it byte-equal to flashinfer's formula).

Call time: activations -> MXFP8 with token-major linear uint8 [T, H/32] scales, then
`trtllm_fp8_block_scale_moe` (router logits, the kernel's routing method for the layer's
runtime.moe.contract.RoutingMethod: `routing_method_type`) or `trtllm_fp8_block_scale_routed_moe`
(externally computed top-k).

SwiGLU: the per-expert gemm1_alpha / gemm1_beta / gemm1_clamp_limit of the contract; an infinite limit (plain
SwiGLU, no clamp) is passed as None, the kernel's "no clamp".

Expert biases: `trtllm_fp8_block_scale_moe(gemm1_bias=, gemm2_bias=)` (keyword-only, fp32 [E, 2I] / [E, H] "in
the same row layout as" the weights): GEMM1's is added before the gated activation, GEMM2's in GEMM2's run, before
finalize weights each expert's output (csrc/trtllm_fused_moe_runner.cu). The routed entry point has no such
parameters in 0.7.2.post1 (core.py passes None: "routed FP8 uses gemm1_lora_delta for MN bias"), so
`forward_topk` refuses a layer with biases rather than drop them.

routed_scaling_factor (applied exactly once):
  logits path  -> the kernel applies it (e.g. MiniMax2 weights = s / (sum s + 1e-20) * rsf); the output is
                  not scaled again.
  routed path  -> precomputed weights are used as given (the post-top-k routing pipeline never runs a
                  postprocess, ref: csrc/fused_moe/trtllm_backend/trtllm_fused_moe_routing_common.cu
                  runPostTopKPipeline), so porter multiplies the fp32 weights by rsf and passes None.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from porter.format import mxfp8
from runtime.moe.contract import (
    SIGMOID_BIAS_TOPK,
    SOFTMAX_TOPK,
    SOFTMAX_TOPK_RENORM,
    TOPK_SOFTMAX,
    TRTLLM_CAPABILITIES,
    BackendUnavailable,
    MoeQuantInfo,
    MoeRouting,
    RoutingMethod,
)

EPILOGUE_TILE_M = 128  # MXFP8 uses 128 (flashinfer/fused_moe/prepare.py, vLLM, sglang); DeepSeekFp8 64
SF_ROW_TILE = 128  # 128x4 swizzle: 128 rows x 4 scale columns per 512-byte tile
SF_COL_TILE = 4
SWIGLU_PARAMS = ("gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit")
BIAS_PARAMS = ("gemm1_bias", "gemm2_bias")
KERNEL_ARCHS = ", ".join(f"SM{a}{b}" for a, b in TRTLLM_CAPABILITIES)
# contract routing -> FlashInfer RoutingMethodType member (flashinfer/fused_moe/core.py; docs/moe-backends.md)
ROUTING_METHODS = {
    SIGMOID_BIAS_TOPK: "MiniMax2",  # Sigmoid + bias -> TopK -> ScaledSumNormalize (bias for selection)
    TOPK_SOFTMAX: "Renormalize",  # TopK -> Softmax
    SOFTMAX_TOPK: "Default",  # Softmax -> TopK
    SOFTMAX_TOPK_RENORM: "RenormalizeNaive",  # Softmax -> TopK -> Renormalize
}


def routing_method_name(method: RoutingMethod, has_bias: bool) -> str:
    """The kernel's RoutingMethodType member for a contract method; BackendUnavailable for one it has not
    (a selection bias exists only in the sigmoid method, MiniMax2)."""
    name = ROUTING_METHODS.get(method)
    if name is None or (has_bias and method != SIGMOID_BIAS_TOPK):
        raise BackendUnavailable(
            f"flashinfer-trtllm MoE has no routing method for {method}"
            f"{' with a selection bias' if has_bias else ''}; use backend='triton' or 'torch'"
        )
    return name


def routing_method_type(method: RoutingMethod, has_bias: bool) -> int:
    """The RoutingMethodType value of routing_method_name (an integer of the installed flashinfer)."""
    return int(getattr(_enums()[2], routing_method_name(method, has_bias)))


# ---------------------------------------------------------------------------------------------------
# Load-time weight preparation (pure functions)
# ---------------------------------------------------------------------------------------------------


def _check_dims(hidden: int, inter: int) -> None:
    # prepare.py: "MXFP8 shuffled MajorK preparation requires hidden_size and intermediate_size
    # divisible by 128"; then the 128x4-swizzled scales need no padding.
    if hidden % 128 or inter % 128:
        raise BackendUnavailable(
            f"flashinfer-trtllm MXFP8 needs hidden_size and intermediate_size divisible "
            f"by 128, got H={hidden}, I={inter}; use backend='triton' or 'torch'"
        )


def w13_row_permutation(two_i: int) -> torch.Tensor:
    """LongTensor [2I]: prepared gemm1 row r holds canonical [gate; up] row p[r].

    Composition (each step is `out = in[idx]`): swap halves to [up; gate] (docs/moe-backends.md), then
    flashinfer's gated-act interleave (ref: fused_moe/core.py get_reorder_rows_for_gated_act_gemm_row_indices:
    row 2j = up_j, 2j+1 = gate_j), then the shuffle_matrix_a rows (ref: utils.py
    get_shuffle_matrix_a_row_indices, 32-row blocks for tile 128). Same chain as core.py
    _maybe_get_cached_w3_w1_permute_indices, plus the swap in front."""
    from flashinfer.fused_moe.core import get_reorder_rows_for_gated_act_gemm_row_indices
    from flashinfer.utils import get_shuffle_matrix_a_row_indices

    inter = two_i // 2
    rows = torch.empty(two_i, 1, dtype=torch.uint8)  # the index functions read only the shape
    up_gate = torch.cat([torch.arange(inter, two_i), torch.arange(inter)])  # [up; gate] <- [gate; up]
    interleave = get_reorder_rows_for_gated_act_gemm_row_indices(rows)
    shuffle = get_shuffle_matrix_a_row_indices(rows, EPILOGUE_TILE_M)
    return up_gate[interleave[shuffle]]


def w2_row_permutation(hidden: int) -> torch.Tensor:
    """LongTensor [H]: prepared gemm2 row r holds canonical row p[r] (shuffle only, no interleave;
    ref: fused_moe/core.py get_w2_permute_indices_with_cache)."""
    from flashinfer.utils import get_shuffle_matrix_a_row_indices

    return get_shuffle_matrix_a_row_indices(torch.empty(hidden, 1, dtype=torch.uint8), EPILOGUE_TILE_M)


def swizzle_scales_128x4(scale: torch.Tensor) -> torch.Tensor:
    """uint8 [E, R, C] linear scales -> uint8 [E, R, C] holding each expert's bytes in the 128x4 layout.

    Torch equivalent of flashinfer.block_scale_interleave (which rejects CPU tensors). Element (r, c) goes
    to flat offset (r//128)*128*C + (c//4)*512 + (r%32)*16 + ((r%128)//32)*4 + c%4
    (ref: data/csrc/nv_internal/tensorrt_llm/thop/fp4Op.cpp computeSFIndex SWIZZLED_128x4;
    kernels/quantization_utils.cuh get_sf_out_offset_128x4), i.e. a view (E, R/128, 4, 32, C/4, 4)
    permuted to (E, R/128, C/4, 32, 4, 4). Needs R % 128 == 0 and C % 4 == 0 (no padding)."""
    e, rows, cols = scale.shape
    if rows % SF_ROW_TILE or cols % SF_COL_TILE:
        raise ValueError(f"128x4 scale swizzle needs rows % 128 == 0 and cols % 4 == 0, got {rows}x{cols}")
    tiles = scale.reshape(e, rows // SF_ROW_TILE, 4, 32, cols // SF_COL_TILE, SF_COL_TILE)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(e, rows, cols)


def _gather_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    # Index bytes (flashinfer does the same: q.view(torch.uint8)[permute]); one copy per tensor.
    return t.view(torch.uint8).index_select(1, rows.to(t.device)).view(t.dtype)


def prepare_w13(w13: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical [gate; up] w13 e4m3 [E, 2I, H] + uint8 [E, 2I, H/32] -> kernel gemm1 tensors (same shapes)."""
    _, two_i, hidden = w13.shape
    _check_dims(hidden, two_i // 2)
    rows = w13_row_permutation(two_i)  # [2I]
    return _gather_rows(w13, rows), swizzle_scales_128x4(_gather_rows(scale, rows))


def prepare_w2(w2: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w2 e4m3 [E, H, I] + uint8 [E, H, I/32] -> kernel gemm2 tensors (same shapes)."""
    _, hidden, inter = w2.shape
    _check_dims(hidden, inter)
    rows = w2_row_permutation(hidden)  # [H]
    return _gather_rows(w2, rows), swizzle_scales_128x4(_gather_rows(scale, rows))


def prepare_biases(w13_bias, w2_bias) -> tuple:
    """Canonical fp32 biases ([E, 2I] [gate; up], [E, H], or None) -> the kernel's gemm1_bias / gemm2_bias:
    the rows of their weights in the same order (w13_row_permutation, w2_row_permutation), contiguous fp32."""
    gemm1 = gemm2 = None
    if w13_bias is not None:
        gemm1 = w13_bias.float().index_select(1, w13_row_permutation(w13_bias.shape[1]).to(w13_bias.device))
    if w2_bias is not None:
        gemm2 = w2_bias.float().index_select(1, w2_row_permutation(w2_bias.shape[1]).to(w2_bias.device))
    return gemm1, gemm2


# ---------------------------------------------------------------------------------------------------
# Call-time helpers (pure functions)
# ---------------------------------------------------------------------------------------------------


def quantize_activations(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H] -> (e4m3 [T, H], uint8 [T, H/32] token-major linear UE8M0 scales; the kernel's
    hidden_states_scale, not swizzled).

    On CUDA: flashinfer.mxfp8_quantize(bf16, is_sf_swizzled_layout=False) (its GPU path takes fp16/bf16
    only). Elsewhere (tests, CPU emulation): porter.format.mxfp8.quantize_activations, the same rule
    (docs/moe-backends.md, "Serving numerics")."""
    if hidden.is_cuda:
        import flashinfer

        x_q, x_sf = flashinfer.mxfp8_quantize(
            hidden.to(torch.bfloat16).contiguous(), is_sf_swizzled_layout=False
        )
        return x_q, x_sf.view(torch.uint8).reshape(hidden.shape[0], hidden.shape[1] // mxfp8.BLOCK)
    return mxfp8.quantize_activations(hidden, name="moe hidden_states")


def pack_topk(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """int32 [T, k] = (expert_id << 16) | bits(bf16 weight) — the PackedPrecomputed form of
    trtllm_fp8_block_scale_routed_moe's topk_ids (flashinfer/fused_moe/core.py).

    Rounds the weights to bf16; `forward_topk` passes the unpacked (ids, fp32 weights) pair instead."""
    bits = topk_weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (topk_ids.to(torch.int32) << 16) | bits


def _enums():
    from flashinfer.fused_moe import ActivationType, Fp8QuantizationType, RoutingMethodType, WeightLayout

    return ActivationType, Fp8QuantizationType, RoutingMethodType, WeightLayout


def _common_kwargs(
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    hidden_q,
    hidden_sf,
    num_experts,
    top_k,
    swiglu,
    routing_method,
) -> dict:
    activation, fp8_type, _, layout = _enums()
    _, two_i, _ = gemm1_weights.shape
    return dict(
        hidden_states=hidden_q,
        hidden_states_scale=hidden_sf,  # e4m3 [T, H], uint8 [T, H/32]
        gemm1_weights=gemm1_weights,
        gemm1_weights_scale=gemm1_weights_scale,  # [E, 2I, H], [E, 2I, H/32]
        gemm2_weights=gemm2_weights,
        gemm2_weights_scale=gemm2_weights_scale,  # [E, H, I], [E, H, I/32]
        num_experts=num_experts,
        top_k=top_k,
        n_group=None,
        topk_group=None,  # no grouped routing
        intermediate_size=two_i // 2,
        local_expert_offset=0,
        local_num_experts=gemm1_weights.shape[0],  # no expert parallelism
        # routed path: precomputed top-k skips the routing postprocess, so the method there only names it
        routing_method_type=routing_method,
        use_shuffled_weight=True,  # launcher: "use_shuffled_weight must be true for MxFp8."
        weight_layout=int(layout.MajorK),  # launcher: "weight_layout must be 0 for MxFp8."
        do_finalize=True,
        fp8_quantization_type=fp8_type.MxFp8,
        activation_type=activation.Swiglu.value,  # integers moved between releases: never a literal
        gemm1_alpha=swiglu["gemm1_alpha"],
        gemm1_beta=swiglu["gemm1_beta"],  # fp32 [E] each
        gemm1_clamp_limit=_clamp(swiglu["gemm1_clamp_limit"]),
    )


def _clamp(limit: torch.Tensor):
    """The per-expert clamp, None (the kernel's "no clamp") when every expert's limit is +inf."""
    return None if bool(torch.isinf(limit).all() and (limit > 0).all()) else limit


def build_moe_kwargs(
    *,
    router_logits,
    routing_bias,
    hidden_q,
    hidden_sf,
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    top_k,
    routed_scaling_factor,
    swiglu,
    method: RoutingMethod = SIGMOID_BIAS_TOPK,
    gemm1_bias=None,
    gemm2_bias=None,
) -> dict:
    """All-keyword arguments of trtllm_fp8_block_scale_moe (logits path, routing in the kernel).

    router_logits fp32 [T, E]; routing_bias = e_score_correction_bias [E] (selection only) or None;
    swiglu = {"gemm1_alpha", "gemm1_beta", "gemm1_clamp_limit"} fp32 [E]; method: the contract's routing
    (routing_method_type). The kernel applies rsf. gemm1_bias / gemm2_bias: prepare_biases' fp32 tensors,
    passed only when the layer has biases."""
    kwargs = _common_kwargs(
        gemm1_weights,
        gemm1_weights_scale,
        gemm2_weights,
        gemm2_weights_scale,
        hidden_q,
        hidden_sf,
        router_logits.shape[1],
        top_k,
        swiglu,
        routing_method_type(method, routing_bias is not None),
    )
    if routing_bias is None and method == SIGMOID_BIAS_TOPK:  # MiniMax2 reads a bias: zeros select alike
        routing_bias = torch.zeros(router_logits.shape[1], device=router_logits.device)
    kwargs.update(
        routing_logits=router_logits.float(),
        routing_bias=None if routing_bias is None else routing_bias.float(),
        routed_scaling_factor=float(routed_scaling_factor),
    )
    biases = {"gemm1_bias": gemm1_bias, "gemm2_bias": gemm2_bias}
    kwargs.update({name: b for name, b in biases.items() if b is not None})
    return kwargs


def build_routed_moe_kwargs(
    *,
    topk_ids,
    topk_weights,
    num_experts,
    hidden_q,
    hidden_sf,
    gemm1_weights,
    gemm1_weights_scale,
    gemm2_weights,
    gemm2_weights_scale,
    routed_scaling_factor,
    swiglu,
    method: RoutingMethod = SIGMOID_BIAS_TOPK,
) -> dict:
    """All-keyword arguments of trtllm_fp8_block_scale_routed_moe (precomputed top-k).

    topk_ids [T, k] (any int), topk_weights [T, k] renormalised, without rsf. Passed unpacked as
    (int32 ids, fp32 weights * rsf) (core.py _split_precomputed_routing: UnpackedPrecomputed) so the weights
    keep fp32; routed_scaling_factor=None because the kernel would not apply it (module docstring)."""
    kwargs = _common_kwargs(
        gemm1_weights,
        gemm1_weights_scale,
        gemm2_weights,
        gemm2_weights_scale,
        hidden_q,
        hidden_sf,
        num_experts,
        topk_ids.shape[1],
        swiglu,
        routing_method_type(method, False),
    )
    weights = (topk_weights.float() * float(routed_scaling_factor)).contiguous()  # rsf applied here, once
    kwargs.update(
        topk_ids=(topk_ids.to(torch.int32).contiguous(), weights),
        routing_bias=None,  # selection already done
        routed_scaling_factor=None,
    )
    return kwargs


def _kernel_output(result, dtype: torch.dtype) -> torch.Tensor:
    # do_finalize=True returns one bf16 tensor today and a list from v0.8.0 on (deprecation warning).
    out = result[0] if isinstance(result, (list, tuple)) else result
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------------
# Support check
# ---------------------------------------------------------------------------------------------------


def _flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def _need(what: str) -> str:
    return (
        f"flashinfer-trtllm MoE needs an NVIDIA {KERNEL_ARCHS} GPU (compute capability 10.0/10.3/10.7: "
        f"B200/GB200, B300/GB300, Rubin) and flashinfer-python installed (pip install 'porter[flashinfer]'); "
        f"{what}"
    )


def check_flashinfer_api(with_biases: bool = False) -> None:
    """The installed flashinfer must have MxFp8, MiniMax2 and the per-expert SwiGLU-OAI parameters (and, for
    a layer with expert biases, the logits path's gemm1_bias / gemm2_bias)."""
    import inspect

    import flashinfer
    from flashinfer.fused_moe import (
        Fp8QuantizationType,
        RoutingMethodType,
        trtllm_fp8_block_scale_moe,
        trtllm_fp8_block_scale_routed_moe,
    )

    missing = [
        f"{enum_cls.__name__}.{member}"
        for enum_cls, member in ((Fp8QuantizationType, "MxFp8"), (RoutingMethodType, "MiniMax2"))
        if not hasattr(enum_cls, member)
    ]
    for fn in (trtllm_fp8_block_scale_moe, trtllm_fp8_block_scale_routed_moe):
        params = inspect.signature(fn).parameters  # gemm1_alpha/beta/clamp_limit arrived in v0.6.13
        missing += [f"{fn.__name__}({p}=)" for p in SWIGLU_PARAMS if p not in params]
    params = inspect.signature(trtllm_fp8_block_scale_moe).parameters  # keyword-only since 0.7.2.post1
    missing += [f"trtllm_fp8_block_scale_moe({p}=)" for p in BIAS_PARAMS if p not in params and with_biases]
    if missing:
        raise BackendUnavailable(
            _need(
                f"installed flashinfer {getattr(flashinfer, '__version__', '?')} "
                f"lacks {', '.join(missing)} (porter pins 0.7.2.post1)"
            )
        )


# ---------------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------------


class TrtllmMoE:
    """MoE through trtllm_fp8_block_scale_moe (MxFp8). Holds only the prepared tensors."""

    name = "flashinfer-trtllm"

    @classmethod
    def check_supported(cls, device, with_biases: bool = False) -> None:
        """Raise BackendUnavailable (one line: the device's capability and what is needed) unless the
        kernel can run here. Checked before any flashinfer import or kernel launch."""
        device = torch.device(device)
        if device.type != "cuda":
            raise BackendUnavailable(_need(f"device {device} is not a CUDA GPU (no compute capability)"))
        if not torch.cuda.is_available():
            raise BackendUnavailable(_need(f"device {device} requested but CUDA is not available"))
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) not in TRTLLM_CAPABILITIES:
            raise BackendUnavailable(
                _need(f"device {device} is SM{major}{minor} (compute capability {major}.{minor})")
            )
        if not _flashinfer_installed():
            raise BackendUnavailable(
                _need(f"device {device} is SM{major}{minor} but flashinfer-python is not installed")
            )
        check_flashinfer_api(with_biases)

    def __init__(self, quant: MoeQuantInfo, routing: MoeRouting):
        quant.validate()
        if not quant.is_mxfp8:
            raise BackendUnavailable(
                "flashinfer-trtllm MoE needs MXFP8 expert weights (float8_e4m3fn + "
                "uint8 scales); these are unquantized — use the torch backend"
            )
        # The canonical tensors are not kept: only the kernel layout lives on (no second copy).
        self.gemm1_weights, self.gemm1_weights_scale = prepare_w13(quant.w13_weight, quant.w13_weight_scale)
        self.gemm2_weights, self.gemm2_weights_scale = prepare_w2(quant.w2_weight, quant.w2_weight_scale)
        self.swiglu = {name: getattr(quant, name) for name in SWIGLU_PARAMS}  # fp32 [E], layer device
        routing_method_name(routing.method, routing.e_score_correction_bias is not None)  # refused at load
        self.gemm1_bias, self.gemm2_bias = prepare_biases(quant.w13_bias, quant.w2_bias)  # or None
        self.routing = routing
        self.num_experts = quant.num_experts

    @property
    def has_biases(self) -> bool:
        return self.gemm1_bias is not None or self.gemm2_bias is not None

    def _weights(self) -> dict:
        return dict(
            gemm1_weights=self.gemm1_weights,
            gemm1_weights_scale=self.gemm1_weights_scale,
            gemm2_weights=self.gemm2_weights,
            gemm2_weights_scale=self.gemm2_weights_scale,
            swiglu=self.swiglu,
            routed_scaling_factor=self.routing.routed_scaling_factor,
        )

    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.routing.logits(hidden)  # [T, E] fp32

    def kernel_kwargs(self, hidden: torch.Tensor) -> dict:
        """hidden [T, H] -> the keyword arguments of trtllm_fp8_block_scale_moe."""
        hidden_q, hidden_sf = quantize_activations(hidden)
        return build_moe_kwargs(
            router_logits=self.router_logits(hidden),
            routing_bias=self.routing.e_score_correction_bias,
            hidden_q=hidden_q,
            hidden_sf=hidden_sf,
            top_k=self.routing.top_k,
            method=self.routing.method,
            gemm1_bias=self.gemm1_bias,
            gemm2_bias=self.gemm2_bias,
            **self._weights(),
        )

    def routed_kernel_kwargs(self, hidden, topk_ids, topk_weights) -> dict:
        """The keyword arguments of trtllm_fp8_block_scale_routed_moe for externally computed top-k."""
        if self.has_biases:
            raise BackendUnavailable(
                "flashinfer-trtllm MoE: this layer has expert biases, which flashinfer 0.7.2.post1's routed entry "
                "point (trtllm_fp8_block_scale_routed_moe) cannot take; call the backend on the hidden states "
                "(router logits path, gemm1_bias / gemm2_bias) or use backend='triton' or 'torch'"
            )
        hidden_q, hidden_sf = quantize_activations(hidden)
        return build_routed_moe_kwargs(
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            num_experts=self.num_experts,
            hidden_q=hidden_q,
            hidden_sf=hidden_sf,
            method=self.routing.method,
            **self._weights(),
        )

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def _checked(device: torch.device, with_biases: bool = False) -> None:
        TrtllmMoE.check_supported(device, with_biases)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> routed output [T, H] (rsf applied by the kernel; shared expert not included)."""
        self._checked(hidden.device, self.has_biases)
        if hidden.shape[0] == 0:
            return torch.zeros_like(hidden)
        from flashinfer.fused_moe import trtllm_fp8_block_scale_moe

        return _kernel_output(trtllm_fp8_block_scale_moe(**self.kernel_kwargs(hidden)), hidden.dtype)

    def forward_topk(self, hidden, topk_ids, topk_weights) -> torch.Tensor:
        """hidden [T, H], topk_ids [T, k], topk_weights [T, k] (renormalised, without rsf) -> [T, H]."""
        self._checked(hidden.device)
        if hidden.shape[0] == 0:
            return torch.zeros_like(hidden)
        from flashinfer.fused_moe import trtllm_fp8_block_scale_routed_moe

        kwargs = self.routed_kernel_kwargs(hidden, topk_ids, topk_weights)
        return _kernel_output(trtllm_fp8_block_scale_routed_moe(**kwargs), hidden.dtype)
