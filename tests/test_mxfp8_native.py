"""porter.format.mxfp8_native (the rule compiled from porter/format/mxfp8_cpu.c) against
porter.format.mxfp8's torch CPU path: the same bytes for every bf16 value under every scale that can reach it,
both roundings; how it is built, cached and given up on. tests/test_mxfp8.py runs the rule tests on both
paths."""

import math
import shutil

import pytest
import torch

from porter.format import mxfp8, mxfp8_native


def torch_path(monkeypatch, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the C function taken away: porter.format.mxfp8's torch tiles run."""
    with monkeypatch.context() as m:
        m.setattr(mxfp8_native, "function", lambda: None)
        return fn(*args, **kwargs)


@pytest.fixture
def native():
    assert mxfp8_native.function() is not None, mxfp8_native.reason()


def every_bf16_under_every_scale() -> torch.Tensor:
    """[N, 32] bf16: every finite bf16 value, in blocks whose amax (the block's last element) puts it at each
    distance below the amax from 0 to 2^-140 binades, so each value meets every e4m3 rounding case it can:
    normal, subnormal, ties, and rounding to 0, with both signs."""
    everything = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = everything[torch.isfinite(everything)].float()  # 65280 values
    rows = []
    for amax_exp in range(-133, 128, 4):  # the block amax: 2^amax_exp * 1.0, 1.5 (rceil's two cases)
        for mant in (1.0, 1.5, 1.75, 1.875):
            amax = mant * 2.0**amax_exp
            if not math.isfinite(amax) or amax > 3.3e38:
                continue
            v = finite[finite.abs() <= amax]
            v = v[: v.numel() // 31 * 31].reshape(-1, 31)
            rows.append(torch.cat([v, torch.full((v.shape[0], 1), amax)], 1))
    return torch.cat(rows).bfloat16()


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_same_bytes_as_torch_for_every_bf16_value(monkeypatch, native, rounding):
    w = every_bf16_under_every_scale()  # ~270k blocks
    q, s, e = mxfp8.quantize_with_error(w, rounding)
    q_ref, s_ref, e_ref = torch_path(monkeypatch, mxfp8.quantize_with_error, w, rounding)
    assert w.shape[0] > 250_000
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    assert e["max_abs_error"] == e_ref["max_abs_error"]
    for k in ("err_sq", "ref_sq"):  # per-block fp32 sums in another order: see tests/test_mxfp8.py
        assert e[k] == e_ref[k] or abs(e[k] - e_ref[k]) <= 3.7e-6 * abs(e_ref[k]), (k, e[k], e_ref[k])
    q2, s2 = mxfp8.quantize(w, rounding)  # without the statistics: the same bytes
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_real_weights_and_fp32_extremes(monkeypatch, native, dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 6144, generator=g) * 0.02  # a real-dims weight slice
    if dtype == torch.float32:  # fp32 blocks spanning 2^-149 .. 2^127, fp32 subnormals included
        w[:8] = torch.randn(8, 6144, generator=g) * torch.logspace(-149, 126, 6144, base=2.0)
    w = w.to(dtype)
    for rounding in ("rceil", "floor"):
        q, s, e = mxfp8.quantize_with_error(w, rounding)
        q_ref, s_ref, e_ref = torch_path(monkeypatch, mxfp8.quantize_with_error, w, rounding)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        assert e["max_abs_error"] == e_ref["max_abs_error"]
        for k in ("err_sq", "ref_sq") if dtype == torch.bfloat16 else ():  # fp32's 2^126 squares overflow
            assert math.isfinite(e_ref[k]) and abs(e[k] - e_ref[k]) <= 3.7e-6 * e_ref[k], (k, e[k], e_ref[k])


@pytest.mark.parametrize("lanes", [8, 16])
def test_either_lane_count_gives_the_same_bytes(monkeypatch, native, tmp_path, lanes):
    """porter builds 16 lanes where the compiler targets AVX-512F and 8 elsewhere; each count, forced with
    -DPORTER_LANES (16 runs split into two registers on a machine without AVX-512), gives the torch path's
    bytes and max |error| for every bf16 value, both roundings, so CI checks the AVX-512 machines' code too."""
    fn = mxfp8_native.build_variant(tmp_path / f"q{lanes}.so", (f"-DPORTER_LANES={lanes}",))
    monkeypatch.setattr(mxfp8_native, "_state", {"fn": fn, "tried": True, "why": ""})
    w = every_bf16_under_every_scale()
    for rounding in ("rceil", "floor"):
        q, s, e = mxfp8.quantize_with_error(w, rounding)
        q_ref, s_ref, e_ref = torch_path(monkeypatch, mxfp8.quantize_with_error, w, rounding)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        assert e["max_abs_error"] == e_ref["max_abs_error"]
        for k in ("err_sq", "ref_sq"):
            assert e[k] == e_ref[k] or abs(e[k] - e_ref[k]) <= 3.7e-6 * abs(e_ref[k]), (k, e[k], e_ref[k])


def test_takes_only_what_it_supports(native):
    w = torch.randn(4, 64)
    assert mxfp8_native.supports(w) and mxfp8_native.supports(w.bfloat16())
    assert not mxfp8_native.supports(w.half())  # fp16: the torch tiles
    assert not mxfp8_native.supports(w.t().contiguous().t())  # not contiguous
    assert not mxfp8_native.supports(w, keep_scale=torch.zeros(4, 2, dtype=torch.uint8))
    assert not mxfp8_native.supports(torch.empty(0, 32))


def test_nan_or_inf_falls_back_and_is_named(native):
    w = torch.randn(8, 96).bfloat16()
    w[3, 70] = float("inf")
    assert mxfp8_native.quantize_blocks(w, "rceil", True) is None
    with pytest.raises(mxfp8.MXFP8Error, match="layers.3.w1.*NaN or Inf"):
        mxfp8.quantize_with_error(w, name="layers.3.w1")


def fresh_state(monkeypatch, tmp_path, cc=None):
    """A first use of the quantizer with an empty cache; cc: the compiler to find (a name or a path)."""
    monkeypatch.setattr(mxfp8_native, "_state", {"fn": None, "tried": False, "why": ""})
    monkeypatch.setenv("PORTER_CACHE_DIR", str(tmp_path / "cache"))
    if cc is not None:
        monkeypatch.setattr(mxfp8_native, "_compiler", lambda: (cc, shutil.which(cc)))


def test_built_once_then_loaded_from_the_cache(monkeypatch, tmp_path):
    fresh_state(monkeypatch, tmp_path)
    assert mxfp8_native.function() is not None
    built = list((tmp_path / "cache").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # no temp file left behind
    stamp = built[0].stat().st_mtime_ns
    fresh_state(monkeypatch, tmp_path)
    assert mxfp8_native.function() is not None
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()] == [stamp]


def test_no_compiler_means_the_torch_path(monkeypatch, tmp_path):
    fresh_state(monkeypatch, tmp_path, cc="no-such-compiler-porter")
    assert mxfp8_native.function() is None
    assert "no C compiler (no-such-compiler-porter)" in mxfp8_native.reason()
    w = (torch.randn(16, 128) * 3).bfloat16()
    q, s, e = mxfp8.quantize_with_error(w)
    assert torch.equal(mxfp8.dequantize(q, s).bfloat16().float(), mxfp8.fake_quantize(w).float())
    assert not (tmp_path / "cache").exists()


def test_a_failing_build_means_the_torch_path(monkeypatch, tmp_path):
    fake_cc = tmp_path / "fake-cc"
    fake_cc.write_text("#!/bin/sh\necho 'fake-cc: error: this compiler cannot build anything' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    fresh_state(monkeypatch, tmp_path, cc=str(fake_cc))
    assert mxfp8_native.function() is None
    assert "cannot build anything" in mxfp8_native.reason()
    assert not any(p.name.endswith(".so") for p in (tmp_path / "cache").iterdir())


def test_the_block_is_the_rules():
    """The C source's block (mxfp8_native.BLOCK, also its K rule) is porter.format.mxfp8's."""
    assert mxfp8_native.BLOCK == mxfp8.BLOCK == 32
    assert "#define BLOCK 32\n" in mxfp8_native.SOURCE.read_text()


@pytest.mark.parametrize(
    "shape, block", [((256, 256), (128, 128)), ((3, 200, 130), (128, 128)), ((2, 64, 96), (16, 32))]
)
def test_fp8_block_dequantize_same_bytes_as_torch(monkeypatch, native, shape, block):
    """The C block-FP8 dequantizer == the torch ops, bit for bit, for every e4m3 code under scales from
    subnormal-producing to overflowing, partial edge tiles and expert dims included; NaN codes stay NaN."""
    g = torch.Generator().manual_seed(sum(shape))
    q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    q.view(torch.uint8).view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every code
    n, k = shape[-2:]
    tiles = (*shape[:-2], -(-n // block[0]), -(-k // block[1]))
    s = 2.0 ** torch.randint(-140, 120, tiles, generator=g).float() * (1 + torch.rand(tiles, generator=g))
    s.view(-1)[0], s.view(-1)[-1] = 1.9 * 2.0**120, 2.0**-140  # products past fp32's range, and below bf16's
    got = mxfp8.dequantize_fp8_block(q, s, block, torch.bfloat16)
    want = torch_path(monkeypatch, mxfp8.dequantize_fp8_block, q, s, block, torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) >= 2  # codes 0x7f and 0xff
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    assert bool(want.isinf().any()) and bool((want[~nan] == 0).any())  # the extremes were reached
