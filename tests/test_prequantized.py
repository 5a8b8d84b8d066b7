"""Pre-quantized sources: the vendor MXFP8 release layout (quant_method mxfp8, U8 weight_scale_inv) and
block-FP8 checkpoints (quant_method fp8, fp32 weight_scale_inv [ceil(N/128), ceil(K/128)]), dequantized and
requantized tensor by tensor; unknown quantization refused. Checkpoints are built in code from the tiny one."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from tensor_checks import cuda_quantize_path_on_cpu, load_all, same_bytes

import converters
import converters.minimax_m3 as m3
import porter
from porter.cli import main as cli
from porter.format import mxfp8
from porter.format.layout import scale_name

arch = converters.get("minimax_m3_vl")  # the MiniMax-M3 converter

# the linears the vendor MXFP8 release quantizes (scope "all" + routed experts), vendor names
VENDOR_QUANTIZED = re.compile(
    r"^language_model\.model\.layers\.\d+\.(self_attn\.(q|k|v|o|index_q|index_k)_proj|"
    r"mlp\.(gate|up|down)_proj|block_sparse_moe\.(shared_experts\.\w+_proj|experts\.\d+\.w[123]))"
    r"\.weight$"
)


def requantized_checkpoint(
    bf16_dir: Path,
    out: Path,
    quantize_one,
    qconfig: dict,
    where: str = "top",
    quantized: re.Pattern = VENDOR_QUANTIZED,
) -> Path:
    """A copy of the bf16 checkpoint whose linears named by `quantized` (default: the vendor scope) are stored
    quantized: quantize_one(w) -> (F8_E4M3 values, scale_inv)."""
    out.mkdir(parents=True)
    for f in bf16_dir.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, out / f.name)
    tensors = {}
    for name, t in load_all(bf16_dir).items():
        if quantized.fullmatch(name):
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = quantize_one(t)
        else:
            tensors[name] = t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    cfg = json.loads((bf16_dir / "config.json").read_text())
    if where == "top":
        cfg["quantization_config"] = qconfig
    else:
        cfg["text_config"]["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def mxfp8_floor(w):
    return mxfp8.quantize(w, "floor")  # a valid MXFP8 encoding that is not porter's rceil choice


def mxfp8_scale_up(w: torch.Tensor):
    """A valid MXFP8 encoding that is not porter's: every other block's scale byte one above rceil's (values
    halved before the e4m3 cast). rceil on the dequantized values picks a smaller exponent for those blocks."""
    _, s = mxfp8.quantize(w)
    s = s.clone()
    s[..., 1::2] += 1
    q, s, _ = mxfp8.quantize_with_error(w, keep_scale=s)
    return q, s


def fp8_block128(w):
    """DeepSeek-V3-style block FP8: one fp32 scale per 128x128 tile (edge tiles partial)."""
    n, k = w.shape
    sn, sk = -(-n // 128), -(-k // 128)
    scale = torch.empty(sn, sk)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(sn):
        for j in range(sk):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s = float(tile.abs().max()) / 448.0 or 1.0
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


MXFP8_CONFIG = {
    "quant_method": "mxfp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [1, 32],
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "ignored_layers": ["language_model.lm_head"],
}
FP8_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def source_values(src: dict, name: str, dequant) -> torch.Tensor:
    return dequant(src[name], src[name[: -len("weight")] + "weight_scale_inv"])


def porter_name(vendor: str) -> str:
    return arch.canonical_name(vendor)


def stacked_expert_value(out: dict, vendor: str) -> torch.Tensor:
    """Dequantized row block of a vendor expert weight inside porter's stacked tensors."""
    m = re.match(
        r"language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", vendor
    )
    layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
    name = m3.experts_w2_name(layer) if w == "w2" else m3.experts_w13_name(layer)
    full = mxfp8.dequantize(out[name][e], out[name + "_scale"][e])
    half = full.shape[0] // 2
    return {"w1": full[:half], "w3": full[half:], "w2": full}[w]


def test_mxfp8_to_mxfp8_rceil_is_lossless(tiny_vendor, tmp_path):
    src_dir = requantized_checkpoint(tiny_vendor, tmp_path / "mx", mxfp8_floor, MXFP8_CONFIG)
    porter.convert(src_dir, tmp_path / "out", quantize="all", progress=False)
    src, out = load_all(src_dir), load_all(tmp_path / "out")
    checked = 0
    for name in src:
        if not VENDOR_QUANTIZED.match(name):
            continue
        want = source_values(src, name, mxfp8.dequantize)
        if ".experts." in name:
            got = stacked_expert_value(out, name)
        else:
            c = porter_name(name)
            got = mxfp8.dequantize(out[c], out[scale_name(c)])
        assert torch.equal(got, want), name  # identical values, not merely close
        checked += 1
    assert checked == 3 * 8 * 3 + 3 * 3 + 3 + 4 * 4 + 3 * 2  # experts, shared, dense mlp, q/k/v/o, index
    doc = json.loads((tmp_path / "out" / "porter.json").read_text())
    assert max(r.get("rel_fro_error", 0.0) for r in doc["tensors"].values()) == 0.0


def test_mxfp8_source_unquantized_outputs_are_exact_bf16(tiny_vendor, tmp_path):
    """--quantize experts from an all-quantized source: attention and shared expert come out as bf16,
    equal to the dequantized source values (MXFP8 values are exact in bf16)."""
    src_dir = requantized_checkpoint(tiny_vendor, tmp_path / "mx", mxfp8_floor, MXFP8_CONFIG)
    porter.convert(src_dir, tmp_path / "out", quantize="experts", progress=False)
    src, out = load_all(src_dir), load_all(tmp_path / "out")
    name = "language_model.model.layers.1.self_attn.index_q_proj.weight"
    got = out[porter_name(name)]
    assert got.dtype == torch.bfloat16 and torch.equal(
        got.float(), source_values(src, name, mxfp8.dequantize)
    )
    assert scale_name(porter_name(name)) not in out


def kept_source_bytes(src: dict, out: dict) -> int:
    """Asserts that every MXFP8 weight of the vendor source comes out with its own value and scale bytes
    (stacked experts: its rows of expert e); returns how many weights were checked."""
    checked = 0
    for name in src:
        if not VENDOR_QUANTIZED.match(name):
            continue
        q, s = src[name], src[name[: -len("weight")] + "weight_scale_inv"]
        m = re.match(
            r"language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", name
        )
        if m:
            layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
            c = m3.experts_w2_name(layer) if w == "w2" else m3.experts_w13_name(layer)
            rows = slice(q.shape[0], None) if w == "w3" else slice(0, q.shape[0])  # [w1; w3]
            got_q, got_s = out[c][e][rows], out[scale_name(c)][e][rows]
        else:
            c = porter_name(name)
            got_q, got_s = out[c], out[scale_name(c)]
        assert same_bytes(got_s, s) and same_bytes(got_q, q), name
        checked += 1
    return checked


@pytest.mark.parametrize("builders", ["plain", "copying", "gpu-path"])
def test_mxfp8_scale_bytes_kept_with_many_units_in_flight(tiny_vendor, tmp_path, monkeypatch, builders):
    """workers=4 and 64 KB shards (dozens of units in flight, each worker reading many tensors) keep every
    source scale byte of every quantized weight, so every value byte too. "copying": every builder returns
    copies of what it read (as a refactor might), which must not matter: kept scales are read by name and
    rows, never matched to the value object. "gpu-path": the --device cuda code (_quantize_cuda, which
    moves the kept bytes to the device) run on the CPU with the stream stubbed."""
    src_dir = requantized_checkpoint(tiny_vendor, tmp_path / "mx", mxfp8_scale_up, MXFP8_CONFIG)
    if builders == "gpu-path":
        cuda_quantize_path_on_cpu(monkeypatch)
    if builders == "copying":
        original = arch.plan_tensors

        def copying_plan(*args, **kwargs):
            out = original(*args, **kwargs)
            for t in out:
                if t.read_whole is not None:
                    t.read_whole = lambda read, f=t.read_whole: f(read).clone()
                else:
                    t.read_expert_rows = lambda read, e, f=t.read_expert_rows: [p.clone() for p in f(read, e)]
            return out

        monkeypatch.setattr(arch, "plan_tensors", copying_plan)
    porter.convert(
        src_dir, tmp_path / "out", quantize="all", max_shard_size="64KB", workers=4, progress=False
    )
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 10
    src, out = load_all(src_dir), load_all(tmp_path / "out")
    assert kept_source_bytes(src, out) == 3 * 8 * 3 + 3 * 3 + 3 + 4 * 4 + 3 * 2
    # and keeping is what does it: rceil on the dequantized values differs in every raised block
    w = "language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight"
    s = src[w[: -len("weight")] + "weight_scale_inv"]
    assert bool((mxfp8.quantize(mxfp8.dequantize(src[w], s, torch.bfloat16))[1][:, 1::2] != s[:, 1::2]).all())


def test_hf_output_converts_back_to_identical_porter_bytes(tiny_vendor, tmp_path):
    porter.convert(tiny_vendor, tmp_path / "direct", quantize="all", progress=False)
    porter.convert(tiny_vendor, tmp_path / "hf", layout="hf", progress=False)  # scope all
    porter.convert(tmp_path / "hf", tmp_path / "back", quantize="all", progress=False)
    direct, back = load_all(tmp_path / "direct"), load_all(tmp_path / "back")
    assert set(direct) == set(back)
    for name in direct:
        assert same_bytes(direct[name], back[name]), name
    # and hf -> hf reproduces the hf artifact's tensors byte for byte
    porter.convert(tmp_path / "hf", tmp_path / "hf2", layout="hf", progress=False)
    hf, hf2 = load_all(tmp_path / "hf"), load_all(tmp_path / "hf2")
    assert set(hf) == set(hf2) and all(same_bytes(hf[n], hf2[n]) for n in hf)
    cfg = json.loads((tmp_path / "hf2" / "config.json").read_text())
    assert (
        cfg["quantization_config"]["ignored_layers"]
        == json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]["ignored_layers"]
    )


def test_dequantize_fp8_block_partial_tiles():
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(130, 200, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, generator=g) + 0.5
    got = mxfp8.dequantize_fp8_block(q, s, (128, 128))
    want = q.float().clone()
    for i in range(130):
        for j in range(200):
            want[i, j] *= s[i // 128, j // 128]
    assert torch.equal(got, want)
    with pytest.raises(mxfp8.MXFP8Error, match=r"expected \[2, 2\]"):
        mxfp8.dequantize_fp8_block(q, s[:1], (128, 128))


def test_dequantize_fp8_block_whole_tiles_scaled_in_place():
    """Whole tiles take the in-place path (a tile view times its scale): the same fp32 products as the
    element-by-element formula, with leading (expert) dims and for bf16 output."""
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(3, 8, 16, generator=g) * 50).to(torch.float8_e4m3fn)  # [E, N, K], tiles 4 x 8
    s = torch.rand(3, 2, 2, generator=g) + 0.5
    want = q.float().clone()
    for e in range(3):
        for i in range(8):
            for j in range(16):
                want[e, i, j] *= s[e, i // 4, j // 8]
    assert torch.equal(mxfp8.dequantize_fp8_block(q, s, (4, 8)), want)
    assert torch.equal(mxfp8.dequantize_fp8_block(q, s, (4, 8), torch.bfloat16), want.bfloat16())


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_fp8_block128_source(tiny_vendor, tmp_path, where):
    src_dir = requantized_checkpoint(tiny_vendor, tmp_path / "fp8", fp8_block128, FP8_CONFIG, where)
    porter.convert(src_dir, tmp_path / "out", quantize="all", progress=False)
    src, out = load_all(src_dir), load_all(tmp_path / "out")
    for name in (
        "language_model.model.layers.0.self_attn.q_proj.weight",
        "language_model.model.layers.2.block_sparse_moe.shared_experts.down_proj.weight",
    ):
        deq = mxfp8.dequantize_fp8_block(src[name], src[name[:-6] + "weight_scale_inv"], (128, 128))
        c = porter_name(name)
        q, s = mxfp8.quantize(deq.bfloat16())  # dequantized once to bf16, then porter's MXFP8 rule
        assert same_bytes(out[c], q) and same_bytes(out[scale_name(c)], s), name
        rel = float((mxfp8.dequantize(out[c], out[scale_name(c)]) - deq).norm() / deq.norm())
        assert rel < 0.05, (name, rel)  # MXFP8 rceil on these weights: ~2-3%
    name = "language_model.model.layers.3.block_sparse_moe.experts.5.w2.weight"
    deq = mxfp8.dequantize_fp8_block(src[name], src[name[:-6] + "weight_scale_inv"], (128, 128))
    assert float((stacked_expert_value(out, name) - deq).norm() / deq.norm()) < 0.05


@pytest.mark.parametrize(
    "qconfig, match",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
        (
            {"quant_method": "fp8", "activation_scheme": "dynamic"},
            "fp8 without a \\[bn, bk\\] weight_block_size",
        ),
        ({"quant_method": "mxfp8", "activation_scheme": "static"}, "activation_scheme 'static'"),
        ({"quant_method": "mxfp8", "weight_block_size": [1, 16]}, "MXFP8 blocks are \\[1, 32\\]"),
    ],
)
def test_unknown_quantization_refused_with_one_line(tiny_vendor, tmp_path, qconfig, match):
    src_dir = tmp_path / "src"
    shutil.copytree(tiny_vendor, src_dir)
    cfg = json.loads((src_dir / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (src_dir / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(cli, ["convert", str(src_dir), "--output", str(tmp_path / "o")])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and "config.json" in lines[0], res.output
    assert re.search(match, lines[0]), lines[0]
    assert not (tmp_path / "o").exists()


def test_mxfp8_source_with_missing_or_bad_scale_refused(tiny_vendor, tmp_path):
    src_dir = requantized_checkpoint(tiny_vendor, tmp_path / "mx", mxfp8_floor, MXFP8_CONFIG)
    t = load_all(src_dir)
    victim = "language_model.model.layers.0.self_attn.o_proj.weight_scale_inv"
    bad = dict(t)
    bad[victim] = t[victim][:, :1].contiguous()  # [N, 1] instead of [N, K/32]
    save_file(bad, str(src_dir / "model.safetensors"))
    res = CliRunner().invoke(cli, ["convert", str(src_dir), "--output", str(tmp_path / "o")])
    assert res.exit_code == 2 and "o_proj.weight" in res.output and "expected uint8 [64, 4]" in res.output
    del bad[victim]
    save_file(bad, str(src_dir / "model.safetensors"))
    res = CliRunner().invoke(cli, ["convert", str(src_dir), "--output", str(tmp_path / "o")])
    assert res.exit_code == 2 and "o_proj.weight" in res.output and "has no" in res.output


def test_rceil_requantization_of_mxfp8_values_is_lossless_and_keep_scale_is_identity():
    """The rule itself: rceil on dequantized MXFP8 values reproduces every value (from porter's rceil
    bytes and from floor-rule bytes). It does not always reproduce the bytes — a block whose largest
    element rounded down to 224 * 2^e gets exponent e - 1 — which is why MXFP8 sources keep their scale
    bytes (keep_scale), and that is the identity."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 512, generator=g) * torch.logspace(-3, 3, 512)  # blocks over many magnitudes
    w[0, :32] = 229.0 * 2.0**-3  # amax/2^e = 229 with e = -3: rounds down to 224, the byte-changing case
    moved = 0
    for rule in ("rceil", "floor"):
        q, s = mxfp8.quantize(w, rule)
        values = mxfp8.dequantize(q, s)
        q2, s2 = mxfp8.quantize(values.bfloat16(), "rceil")
        assert torch.equal(mxfp8.dequantize(q2, s2), values)  # lossless
        moved += int((s2 != s).sum())
        q3, s3, err = mxfp8.quantize_with_error(values.bfloat16(), "rceil", keep_scale=s)
        assert same_bytes(q3, q) and same_bytes(s3, s) and err["err_sq"] == 0.0
    assert moved > 0  # the rule alone would not round-trip bytes
    q, s = mxfp8.quantize(w)
    with pytest.raises(mxfp8.MXFP8Error, match="do not fit the scale bytes"):
        mxfp8.quantize_with_error(w * 4, keep_scale=s)


def test_porter_layout_artifact_as_source_refused(tiny_vendor, tmp_path):
    porter.convert(tiny_vendor, tmp_path / "art", progress=False)
    res = CliRunner().invoke(cli, ["convert", str(tmp_path / "art"), "--output", str(tmp_path / "o")])
    lines = res.output.strip().splitlines()
    assert (
        res.exit_code == 2
        and len(lines) == 1
        and "porter-layout artifact" in lines[0]
        and "--layout hf" in lines[0]
    )
