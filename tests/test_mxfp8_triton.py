"""porter.format.mxfp8_triton (the fused GPU quantizer of --device cuda) against porter.format.mxfp8 on the
CPU: the same value and scale bytes on every finite bf16 value (in blocks of neighbouring magnitudes and in
mixed blocks, where most values land on e4m3 subnormals, zero and rounding ties), on fp16 and fp32 with zero,
subnormal and huge blocks, for both scale roundings; the same error statistics up to summation order; NaN and
Inf counted."""
import pytest
import torch

from porter.format import mxfp8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fused():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from porter.format import mxfp8_triton
    return mxfp8_triton


def all_finite_bf16() -> torch.Tensor:
    """Every finite bf16 bit pattern (65,280 of them), padded with zeros to whole [.., 256] rows."""
    v = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[torch.isfinite(v)]
    pad = (-v.numel()) % 256
    return torch.cat([v, torch.zeros(pad, dtype=torch.bfloat16)]).reshape(-1, 256)


def assert_same(w: torch.Tensor, fused, rounding: str, stats_too: bool = True):
    q, s, stats = fused.quantize_with_error(w.cuda(), rounding, "w")
    q_ref, s_ref, ref = mxfp8.quantize_with_error(w, rounding, "w")
    assert torch.equal(s.cpu(), s_ref)
    diff = (q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, (diff[:5].tolist(), w[tuple(diff[0])].item())
    got = stats.cpu().tolist()
    assert got[3] == 0
    if stats_too:
        assert got[0] == pytest.approx(ref["err_sq"], rel=1e-6)  # fp32 block sums in another order
        assert got[1] == pytest.approx(ref["ref_sq"], rel=1e-6)  # fp32 block sums in another order
        assert got[2] == ref["max_abs_error"]  # a max of exact products: order-free


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_every_bf16_value(fused, rounding):
    v = all_finite_bf16()
    by_magnitude = v.flatten()[v.flatten().float().abs().argsort()].reshape(v.shape)  # blocks of neighbours
    mixed = v.flatten()[torch.randperm(v.numel(), generator=torch.Generator().manual_seed(0))].reshape(v.shape)
    for w in (by_magnitude, mixed):  # squares overflow fp32 at the top: statistics compared below instead
        assert_same(w, fused, rounding, stats_too=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_realistic_tensors_and_edge_blocks(fused, dtype, rounding):
    g = torch.Generator().manual_seed(1)
    rows = torch.logspace(-6, 4, 40).unsqueeze(1)  # fp16 holds these row scales
    w = (torch.randn(40, 4096, generator=g) * rows).to(dtype)
    w[0] = 0  # all-zero blocks: byte 0
    w[1, :96] = 0
    if dtype == torch.float32:
        w[2] = torch.randn(4096, generator=g) * 1e-40  # subnormal amax
        w[3, :7] = 3.0e38
    assert_same(w, fused, rounding)
    assert_same(w[:, :32 * 37].contiguous(), fused, rounding)  # a last program with idle rows


def test_expert_part_bytes_and_stats(fused):
    """A [3072, 6144] part, as --device cuda quantizes them (MiniMax-M3's gate/up/down dims)."""
    w = (torch.randn(3072, 6144, generator=torch.Generator().manual_seed(2)) * 0.02).bfloat16()
    assert_same(w, fused, "rceil")


def test_nan_and_inf_are_counted(fused):
    w = torch.randn(16, 256).cuda()
    w[3, 40], w[9, 7], w[15, 255] = float("nan"), float("inf"), -float("inf")
    assert fused.quantize_with_error(w, "rceil", "w")[2][3].item() == 3
    assert not fused.supports(w[:, :100])  # K % 32 != 0: the torch path (and its error)
    assert not fused.supports(w, keep_scale=torch.zeros(16, 8, dtype=torch.uint8))
