"""porter.format.mxfp8 against a plain float64 re-derivation of the rules (docs/mxfp8.md).

Tests that take `cpu_quantizer` run twice: on the torch CPU path and on the compiled C path
(porter.format.mxfp8_native), which must give the same bytes. Every random draw uses an explicit seeded
generator (`gen`), so each test sees the same data on every run."""

import math

import pytest
import torch

from porter.format import mxfp8, mxfp8_native

# every finite non-negative float8_e4m3fn value, indexed by its code (0x00 .. 0x7E = 448)
GRID = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def use_torch_path(monkeypatch):
    """The CPU quantizer without its compiled C function: the torch tiles run."""
    monkeypatch.setattr(mxfp8_native, "function", lambda: None)


@pytest.fixture(params=["torch", "native"])
def cpu_quantizer(request, monkeypatch):
    """The CPU path for the test; "native" must really be the C path (the test machines have cc)."""
    if request.param == "torch":
        use_torch_path(monkeypatch)
    else:
        assert mxfp8_native.function() is not None, mxfp8_native.reason()
    return request.param


@pytest.fixture
def torch_quantizer(monkeypatch):
    """For tests of the torch CPU path's own internals (tiles, shortcuts, buffers)."""
    use_torch_path(monkeypatch)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ref_round_e4m3(v: float) -> float:
    """Round-to-nearest-even onto the E4M3 grid, saturating at 448 (float64, by table)."""
    a = min(abs(v), 448.0)
    hi = int(torch.searchsorted(GRID, torch.tensor(a, dtype=torch.float64)))
    if hi < len(GRID) and GRID[hi] == a:
        return math.copysign(a, v)
    lo = hi - 1
    dl, dh = a - float(GRID[lo]), float(GRID[hi]) - a
    pick = lo if dl < dh or (dl == dh and lo % 2 == 0) else hi  # tie -> even mantissa (even code)
    return math.copysign(float(GRID[pick]), v)


def ref_quantize(w: torch.Tensor, rounding="rceil"):
    """Block by block in float64: smallest e with amax <= 448 * 2^e (rceil) or floor(log2 amax) - 8."""
    w64 = w.double().reshape(-1, w.shape[-1] // 32, 32)
    q = torch.zeros_like(w64)
    s = torch.zeros(w64.shape[:-1], dtype=torch.int64)
    for r in range(w64.shape[0]):
        for b in range(w64.shape[1]):
            blk = w64[r, b]
            amax = float(blk.abs().max())
            if amax == 0:
                continue
            if rounding == "rceil":
                e = math.floor(math.log2(amax / 448)) - 2
                while 448 * 2.0**e < amax:
                    e += 1
            else:
                e = math.floor(math.log2(amax))
                e += 1 if 2.0 ** (e + 1) <= amax else 0
                e -= 1 if 2.0**e > amax else 0
                e -= 8
            byte = min(max(e + 127, 0), 254)
            s[r, b] = byte
            scale = 2.0 ** (byte - 127)
            q[r, b] = torch.tensor([ref_round_e4m3(float(x) / scale) for x in blk], dtype=torch.float64)
    return q.reshape(w.shape), s.reshape(*w.shape[:-1], w.shape[-1] // 32)


def assert_matches_reference(w, rounding="rceil"):
    q, s = mxfp8.quantize(w, rounding)
    q_ref, s_ref = ref_quantize(w, rounding)
    assert s.dtype == torch.uint8 and q.dtype == torch.float8_e4m3fn
    assert torch.equal(s.long(), s_ref), (s.long() - s_ref).abs().max()
    assert torch.equal(q.double(), q_ref)
    return q, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_matches_reference(dtype, cpu_quantizer):
    w = (torch.randn(6, 128, generator=gen()) * torch.logspace(-3, 3, 6).unsqueeze(1)).to(dtype)
    assert_matches_reference(w)


def test_exact_powers_of_two_and_448_ties(cpu_quantizer):
    rows = []
    for k in (-20, -1, 0, 3, 40):
        rows.append(torch.full((32,), 2.0**k))  # exact power of two
        tie = torch.linspace(-1, 1, 32) * 448 * 2.0**k
        tie[5] = 448 * 2.0**k  # amax/448 exactly 2^k: e = k, the block reaches exactly 448
        rows.append(tie)
        above = tie.clone()
        above[5] = torch.nextafter(torch.tensor(448 * 2.0**k), torch.tensor(math.inf))  # just above: e = k+1
        rows.append(above)
    w = torch.stack(rows)
    q, s = assert_matches_reference(w)
    assert int(s[1, 0]) == 127 - 20 and float(q[1, 5].float()) == 448.0
    assert int(s[2, 0]) == 127 - 19


def test_zero_blocks_and_extreme_exponents(cpu_quantizer):
    w = torch.zeros(4, 64)
    w[1, :32] = 1e-40  # fp32 subnormal: e far below -127 -> byte clamps to 0
    w[1, 40] = 3e-39
    w[2, :32] = (torch.linspace(-1, 1, 32, dtype=torch.float64) * 3e38).float()  # huge: e = 120
    w[3, 32:] = torch.randn(32, generator=gen()) * 1e-30
    q, s = assert_matches_reference(w)
    assert s[0].tolist() == [0, 0]  # all-zero blocks get byte 0, elements 0
    assert torch.all(q[0].float() == 0)
    assert int(s[2, 0]) == 127 + 120
    assert int(s[1, 0]) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_floor_rule_matches_reference_and_clips(seed, cpu_quantizer):
    w = torch.randn(4, 96, generator=gen(seed)) * 10
    # Block 0 of row 0: every other element below 16, so 30.4 = 1.9 * 2^4 is the block's amax whatever
    # the draw (an unclamped draw above 30.4 would change the expected value).
    w[0, :32].clamp_(-16.0, 16.0)
    w[0, 3] = 1.9 * 2**4  # mantissa above 1.75: floor clips to 448 * 2^(4-8) = 28 < 30.4
    q, s = assert_matches_reference(w, "floor")
    assert int(s[0, 0]) == 127 + 4 - 8  # floor(log2 30.4) - 8
    deq = mxfp8.dequantize(q, s)
    assert float(deq[0, 3]) == 28.0
    q2, s2 = mxfp8.quantize(w, "rceil")
    assert int(s2[0, 0]) == 127 + 4 - 8 + 1  # rceil: 448 * 2^-3 = 56 >= 30.4, nothing clips
    assert float(mxfp8.dequantize(q2, s2)[0, 3]) == 30.0  # 30.4 / 2^-3 = 243.2 -> e4m3 240
    assert mxfp8.error_stats(w, q2, s2)["rel_fro_error"] <= mxfp8.error_stats(w, q, s)["rel_fro_error"]


def test_dequantize_and_error_stats(cpu_quantizer):
    w = torch.randn(16, 256, generator=gen()).to(torch.bfloat16)
    q, s = mxfp8.quantize(w)
    deq = mxfp8.dequantize(q, s)
    ref = (q.double().reshape(16, 8, 32) * torch.pow(2.0, s.double() - 127).unsqueeze(-1)).reshape(16, 256)
    assert torch.equal(deq.double(), ref)
    stats = mxfp8.error_stats(w, q, s)
    # e4m3 has 3 mantissa bits: relative rounding error per element <= 2^-4; typical Frobenius ~3%
    assert 0.005 < stats["rel_fro_error"] < 0.0625
    assert stats["max_abs_error"] == float((w.double() - ref).abs().max())


def test_bad_inputs_name_the_tensor(cpu_quantizer):
    with pytest.raises(mxfp8.MXFP8Error, match="layers.3.w1.*multiple of 32"):
        mxfp8.quantize(torch.randn(4, 48, generator=gen()), name="layers.3.w1")
    w = torch.randn(4, 64, generator=gen())
    w[2, 7] = float("nan")
    with pytest.raises(mxfp8.MXFP8Error, match="experts.5.*NaN or Inf"):
        mxfp8.quantize(w, name="experts.5")
    w[2, 7] = float("inf")
    with pytest.raises(mxfp8.MXFP8Error, match="NaN or Inf"):
        mxfp8.quantize(w)


def test_scale_bytes_never_255_and_stored_as_uint8(cpu_quantizer):
    w = torch.randn(64, 64, generator=gen()).clamp(-4, 4) * (3e38 / 4)
    _, s = mxfp8.quantize(w)
    assert s.dtype == torch.uint8 and int(s.max()) <= 254


def test_quantize_with_error_matches_float64_stats(cpu_quantizer):
    w = torch.randn(32, 256, generator=gen()).to(torch.bfloat16) * 3
    q, s, parts = mxfp8.quantize_with_error(w)
    q2, s2 = mxfp8.quantize(w)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    ref = mxfp8.error_stats(w, q, s)
    assert abs((parts["err_sq"] / parts["ref_sq"]) ** 0.5 - ref["rel_fro_error"]) <= 1e-9
    assert parts["max_abs_error"] == ref["max_abs_error"]


def test_e4m3_table_decode_equals_cast():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # all but the two NaN codes
    assert torch.equal(mxfp8.e4m3_to_float(codes), codes.float())


def test_pow2_exact_over_the_whole_range():
    e = torch.arange(-149, 128)
    assert torch.equal(mxfp8.pow2(e).double(), torch.pow(2.0, e.double()))
    assert torch.equal(
        mxfp8.scale_multipliers(torch.arange(255, dtype=torch.uint8)).double(),
        torch.pow(2.0, torch.arange(255).double() - 127),
    )


# ---- the CPU tiled path (mxfp8._quantize_cpu_tiles) against a direct implementation of the rule ----


def direct_quantize_with_error(w: torch.Tensor, rounding: str = "rceil", keep_scale=None):
    """The rule as docs/mxfp8.md states it, step by step, with no shortcut: fp32 blocks, frexp exponent,
    fp32 power-of-two scaling, clamp, torch's cast; error statistics from q.float() with per-block fp32
    sums (mul + sum over the block) and float64 totals. The error is W - deq(Q): floor's clipping counts."""
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)  # [..., K/32, 32]
    amax = x.abs().amax(-1)
    if keep_scale is None:
        mant, expo = torch.frexp(amax)
        e = torch.where(mant <= 0.875, expo - 9, expo - 8) if rounding == "rceil" else expo - 9
        byte = torch.where(amax == 0, 0, (e.long() + 127).clamp(0, 254))
    else:
        byte = keep_scale.long()
    factor = torch.pow(2.0, 127.0 - byte.double()).unsqueeze(-1)  # exact in float64
    xs = (x.double() * factor).float()  # the fp32 product (one rounding, as in fp32)
    q = xs.clamp(-448, 448).to(torch.float8_e4m3fn)  # saturated
    d = xs - q.float()
    step = torch.pow(2.0, byte.double() - 127)
    stats = {
        "err_sq": float(((d * d).sum(-1).double() * step * step).sum()),
        "ref_sq": float((x * x).sum(-1).double().sum()),
        "max_abs_error": float((d.abs().amax(-1).double() * step).max()),
    }
    return q.reshape(w.shape), byte.to(torch.uint8), stats


def awkward_weights(dtype: torch.dtype, seed: int, extreme: bool) -> torch.Tensor:
    """[40, 256]: Gaussian rows over a wide range of magnitudes, plus zero, -0 and e4m3-subnormal blocks and
    exact e4m3 ties; extreme: also fp32-subnormal, huge, tiny and 2^200-spanning blocks."""
    g = gen(seed)
    lo, hi = (-4, 4) if dtype == torch.float16 else (-30, 30) if extreme else (-15, 15)
    w = torch.randn(40, 256, generator=g) * torch.logspace(lo, hi, 40).unsqueeze(1)
    w.view(-1)[torch.randint(0, w.numel(), (500,), generator=g)] = 0.0
    w[0, :32] = 0.0
    w[0, 32:64] = -0.0
    w[1, :32] = torch.linspace(-1, 1, 32) * 2.0**-14  # all e4m3 subnormals after scaling by some blocks
    w[2, 64:96] = 448 * 2.0**-3 * (torch.arange(32) % 16) / 15  # ties and exact grid points
    if extreme and dtype != torch.float16:
        w[3, :32] = 1e-40  # fp32/bf16 subnormal
        w[3, 32:64] = torch.randn(32, generator=g) * 1e-38
        w[4, :32] = torch.linspace(-1, 1, 32) * 3e38  # huge
        w[5, :32] = torch.randn(32, generator=g) * 1e-30
        w[5, 40] = 1e30  # one block spanning 2^200
    return w.to(dtype)


# The C path sums each block's 32 fp32 terms in its own fixed order, torch in its SIMD width's: two orders
# of 32 non-negative terms differ by at most 2 * 31 * 2^-24 = 3.7e-6 relative, per block and in total.
SUM_ORDER_REL = 3.7e-6


def assert_same(got, want):
    """Same bytes; the same statistics (identical on the torch path, within SUM_ORDER_REL on the C path,
    whose max |error| is still identical: a max does not depend on order)."""
    (q, s, e), (q_ref, s_ref, e_ref) = got, want
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    native = mxfp8_native.function() is not None
    for k in e_ref:
        if native and k != "max_abs_error" and e[k] != e_ref[k]:
            assert abs(e[k] - e_ref[k]) <= SUM_ORDER_REL * abs(e_ref[k]), (k, e[k], e_ref[k])
        else:  # identical numbers, not merely close
            assert e[k] == e_ref[k] and math.copysign(1, e[k]) == math.copysign(1, e_ref[k]), (
                k,
                e[k],
                e_ref[k],
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rounding", ["rceil", "floor"])
@pytest.mark.parametrize("extreme", [False, True])
def test_cpu_tiles_match_direct_rule(monkeypatch, dtype, rounding, extreme, cpu_quantizer):
    monkeypatch.setattr(mxfp8, "CPU_TILE_BLOCKS", 7)  # many tiles, a partial last one
    general = []
    real = mxfp8._quantize_general
    monkeypatch.setattr(mxfp8, "_quantize_general", lambda *a: general.append(1) or real(*a))
    for seed in range(3):
        w = awkward_weights(dtype, seed, extreme)
        want = direct_quantize_with_error(w, rounding)
        assert_same(mxfp8.quantize_with_error(w, rounding), want)
        for tile in (3, 1 << 17):  # explicit tiles (the pipeline's choice past 2 workers): same numbers
            assert_same(mxfp8.quantize_with_error(w, rounding, tile_blocks=tile), want)
        q, s = mxfp8.quantize(w, rounding)
        assert torch.equal(q.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(s, want[1])
        for shape in ((8, 5, 256), (10240,)):  # stacked experts; one row
            w3 = w.reshape(shape)
            assert_same(mxfp8.quantize_with_error(w3, rounding), direct_quantize_with_error(w3, rounding))
    # the tiled path did the work, except where bf16 squares leave the float range (extreme blocks); the C
    # path takes bf16 and fp32 itself, fp16 goes to the tiles
    if cpu_quantizer == "torch" or dtype == torch.float16:
        assert bool(general) == (extreme and dtype == torch.bfloat16)
    else:
        assert general == []


def test_cpu_tiles_take_the_shortcuts_on_ordinary_weights(monkeypatch, torch_quantizer):
    """bf16 weights within 2^-63..2^64 never reach the general path; a huge or tiny block sends the call there
    (amax from the squares would not be exact), with the same result."""
    general = []
    real = mxfp8._quantize_general
    monkeypatch.setattr(mxfp8, "_quantize_general", lambda *a: general.append(1) or real(*a))
    w = (torch.randn(64, 512, generator=gen()) * 0.02).bfloat16()
    w[3, :32] = 0.0
    assert_same(mxfp8.quantize_with_error(w), direct_quantize_with_error(w))
    assert general == []
    w[5, 7] = 2.0**70
    assert_same(mxfp8.quantize_with_error(w), direct_quantize_with_error(w))
    assert general == [1]


def test_cpu_tiles_keep_scale(cpu_quantizer):  # kept scale bytes always take the torch path
    w = (torch.randn(24, 192, generator=gen()) * 3).bfloat16()
    q, s = mxfp8.quantize(w)
    values = mxfp8.dequantize(q, s)
    for src in (values, values.bfloat16()):
        got = mxfp8.quantize_with_error(src, keep_scale=s)
        assert_same(got, direct_quantize_with_error(src, keep_scale=s))
        assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[1], s)
        assert got[2]["err_sq"] == 0.0
    s_small = s.clone()
    s_small[2, 1] -= 3  # a block whose values no longer fit its byte
    with pytest.raises(mxfp8.MXFP8Error, match="blk.*do not fit the scale bytes"):
        mxfp8.quantize_with_error(values, keep_scale=s_small, name="blk")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_tiles_refuse_nan_and_inf(dtype, cpu_quantizer):
    w = torch.randn(8, 96, generator=gen()).to(dtype)
    for bad in (float("nan"), float("inf"), -float("inf")):
        w[6, 50] = bad
        with pytest.raises(mxfp8.MXFP8Error, match="experts.2.*NaN or Inf"):
            mxfp8.quantize_with_error(w, name="experts.2")


def test_cpu_tiles_thread_local_buffers(cpu_quantizer):
    """Conversion workers quantize concurrently: each thread has its own tile buffers."""
    from concurrent.futures import ThreadPoolExecutor

    ws = [(torch.randn(96, 1024, generator=gen(i)) * 10.0 ** (i - 4)).bfloat16() for i in range(8)]
    want = [mxfp8.quantize_with_error(w) for w in ws]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            for got, ref in zip(pool.map(mxfp8.quantize_with_error, ws), want):
                assert_same(got, ref)


def test_scale_field_bits_equal_frexp_rule():
    """The bit formula of the tiled path gives the frexp rule's bytes: every finite bf16 magnitude, and every
    fp32 exponent with the mantissas around the 1.75 boundary."""
    bf16 = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    mant_bits = torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF], dtype=torch.int32)
    fp32 = (
        ((torch.arange(255, dtype=torch.int32) << 23).unsqueeze(1) | mant_bits)
        .reshape(-1)
        .view(torch.float32)
    )
    fp32 = torch.cat([fp32, torch.rand(100000, generator=gen()) * torch.logspace(-45, 38, 100000)])
    for amax in (bf16, fp32):
        for rounding in ("rceil", "floor"):
            e = mxfp8.scale_exponents(amax, rounding)
            want = torch.where(amax == 0, 0, (e + 127).clamp(0, 254))
            got = (mxfp8._scale_field(amax.contiguous(), rounding) - 8).clamp_min(0)
            assert torch.equal(got, want)
            assert int(got.max()) <= 247


def test_sqrt_of_square_is_exact_for_bf16_and_fp16():
    """The tiled path's amax = sqrt(max x^2) for bf16/fp16 blocks: exact for every magnitude whose square is a
    normal float (the path checks that range and goes the general way outside it)."""
    for dtype, top in ((torch.bfloat16, 0x7F80), (torch.float16, 0x7C00)):
        x = torch.arange(0, top, dtype=torch.int32).to(torch.int16).view(dtype).float()
        sq = x * x
        ok = (sq >= 2.0**-126) & torch.isfinite(sq)
        assert torch.equal(sq[ok].sqrt(), x[ok])
        assert dtype == torch.bfloat16 or bool(ok[1:].all())  # every fp16 magnitude is in range


def test_e4m3_fp16_decode_is_exact():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # all but the two NaN codes
    half = mxfp8._e4m3_as_fp16_div256(codes, torch.empty(codes.shape, dtype=torch.int16))
    assert torch.equal(half.float() * 256, codes.float())
    assert torch.equal(torch.signbit(half), torch.signbit(codes.float()))


def test_error_totals_steps_for_every_byte():
    """The float64 steps 2^(byte-127) and their squares, built from bits, for every scale byte 0..254."""
    byte = torch.arange(255, dtype=torch.uint8)
    ones = torch.ones(255)
    stats = mxfp8._error_totals(ones, ones, ones, byte, "cpu")
    step = torch.pow(2.0, torch.arange(255, dtype=torch.float64) - 127)
    assert float(stats["err_sq"]) == float((step * step).sum())
    assert float(stats["max_abs_error"]) == 2.0**127 and float(stats["ref_sq"]) == 255.0
    for b in (0, 1, 126, 127, 128, 254):
        one = mxfp8._error_totals(ones[:1], ones[:1], ones[:1] * 3, byte[b : b + 1], "cpu")
        assert float(one["err_sq"]) == 4.0 ** (b - 127) and float(one["max_abs_error"]) == 3 * 2.0 ** (
            b - 127
        )


def test_floor_error_statistics_include_clipping():
    """Under floor a block whose largest value exceeds 448 * 2^e is clipped; the recorded error is that of
    W - deq(Q), clipping included (the CPU tile path and the reference path alike)."""
    w = torch.ones(2, 64)
    w[:, 0] = (
        30.4  # floor: e = floor(log2 30.4) - 8 = -4, 30.4 * 16 = 486.4 > 448: clipped to 448 * 2^-4 = 28
    )
    for x in (w, w.double()):  # float32 takes the tile path, float64 the reference path
        q, s, err = mxfp8.quantize_with_error(x, "floor")
        deq = mxfp8.dequantize(q, s)
        assert float(deq[0, 0]) == 28.0
        assert err["max_abs_error"] == pytest.approx(2.4, rel=1e-6)  # 30.4 - 28
        assert err["err_sq"] == pytest.approx(float(((x.float() - deq) ** 2).sum()), rel=1e-6)
