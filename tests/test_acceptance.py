"""One acceptance rule for `porter convert` and `porter verify`: what one refuses, the other refuses with
the same words, from the same function (porter.format.safetensors_io.parse_header for names, metadata and
E8M0 dtypes; porter.format.prequantized.zeroed_scale_problem for scale bytes).

Each defect is planted in a copy of the tiny checkpoint: convert must refuse it (exit 2, one line naming the
file and the tensor, nothing written), and verify of a clean conversion against the damaged copy as its
reference must refuse it with the same line."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from test_prequantized import MXFP8_CONFIG, load_all, requantized_checkpoint

from porter.cli import main as cli
from porter.format import mxfp8

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

O_PROJ = "language_model.model.layers.0.self_attn.o_proj.weight"


def _last_shard(src: Path) -> Path:
    return sorted(src.glob("*.safetensors"))[-1]


def _add_tensor(src: Path, name: str, t: torch.Tensor) -> tuple[Path, str]:
    f = _last_shard(src)
    tensors = load_file(str(f))
    tensors[name] = t
    save_file(tensors, str(f), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = f.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return f, repr(name)


def control_character_name(src: Path):
    return _add_tensor(src, "vision_tower.extra\nbias", torch.ones(4))


def carried_e8m0(src: Path):
    return _add_tensor(
        src,
        "vision_tower.extra_exponents",
        torch.full((4,), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
    )


def metadata_not_strings(src: Path):
    f = _last_shard(src)
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"] = {"format": "pt", "step": 5}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    return f, "__metadata__['step']"


def zeroed_scale(src: Path):
    f = src / "model.safetensors"
    tensors = load_all(src)
    scale = O_PROJ + "_scale_inv"
    tensors[scale] = tensors[scale].clone()
    tensors[scale][1, 2] = 0  # a block of non-zero values
    save_file(tensors, str(f))
    return f, repr(O_PROJ)


CASES = {
    "control character in a name": (control_character_name, "control character ('\\n')"),
    "carried F8_E8M0 tensor": (carried_e8m0, "is F8_E8M0 but not an MXFP8 scale"),
    "__metadata__ value not a string": (metadata_not_strings, "is int 5, not a string"),
    "zero scale byte on a non-zero block": (
        zeroed_scale,
        "1 block(s) with scale byte 0 (2^-127) but non-zero values, first at row 1, block 2",
    ),
}


@pytest.fixture(scope="module")
def mx_clean(tiny_vendor, tmp_path_factory) -> Path:
    """The vendor MXFP8 layout (rceil scales) of the tiny checkpoint."""
    return requantized_checkpoint(
        tiny_vendor, tmp_path_factory.mktemp("acc") / "mx", mxfp8.quantize, MXFP8_CONFIG
    )


@pytest.fixture(scope="module")
def clean_artifacts(tiny_vendor, mx_clean, tmp_path_factory) -> dict:
    out = {}
    for kind, src in (("bf16", tiny_vendor), ("mxfp8", mx_clean)):
        art = tmp_path_factory.mktemp("acc") / kind
        res = CliRunner().invoke(
            cli, ["-q", "convert", str(src), "--output", str(art), "--quantize", "all", "--device", "cpu"]
        )
        assert res.exit_code == 0, res.output
        out[kind] = art
    return out


@pytest.mark.parametrize("case", CASES)
def test_convert_and_verify_refuse_alike(case, tiny_vendor, mx_clean, clean_artifacts, tmp_path):
    plant, words = CASES[case]
    kind = "mxfp8" if plant is zeroed_scale else "bf16"
    src = tmp_path / "src"
    shutil.copytree(mx_clean if kind == "mxfp8" else tiny_vendor, src)
    f, tensor = plant(src)

    res = CliRunner().invoke(
        cli,
        ["-q", "convert", str(src), "--output", str(tmp_path / "o"), "--quantize", "all", "--device", "cpu"],
    )
    convert_line = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(convert_line) == 1, res.output
    assert f"{f}: " in convert_line[0] and tensor in convert_line[0] and words in convert_line[0]
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()

    res = CliRunner().invoke(
        cli, ["-q", "verify", str(clean_artifacts[kind]), "--reference", str(src), "--max-new-tokens", "0"]
    )
    verify_lines = [line for line in res.output.strip().splitlines() if str(f) in line]
    assert res.exit_code == 2 and len(verify_lines) == 1, res.output
    assert verify_lines[0].split(str(f), 1)[1] == convert_line[0].split(str(f), 1)[1]  # the same words


def test_verify_refuses_a_zeroed_scale_in_the_artifact_by_the_same_rule(clean_artifacts, tmp_path):
    """The artifact side: the integrity step words a zeroed output scale as convert words a source one."""
    from verify_tamper import rewrite_tensor

    art = tmp_path / "art"
    shutil.copytree(clean_artifacts["mxfp8"], art)
    name = "model.layers.0.self_attn.o_proj.weight_scale"

    def zero_block(s):  # [N, K/32] uint8: block 2 of row 1
        s = s.clone()
        s[1, 2] = 0
        return s

    rewrite_tensor(art, name, zero_block)
    res = CliRunner().invoke(cli, ["verify", str(art), "--max-new-tokens", "0"])
    assert res.exit_code == 1, res.output
    assert "1 block(s) with scale byte 0 (2^-127) but non-zero values, first at row 1, block 2" in res.output


@pytest.mark.parametrize(
    "block", [[0, 128], [-1, 128], [128], [128, 128, 1], [1 << 40, 128], [128, 1e3], [True, 128], "128", None]
)
def test_absurd_weight_block_size_refused_quickly(tiny_vendor, tmp_path, block):
    src = tmp_path / "src"
    shutil.copytree(tiny_vendor, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
    }
    (src / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    res = CliRunner().invoke(cli, ["convert", str(src), "--output", str(tmp_path / "o")])
    assert time.perf_counter() - t0 < 5
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and str(src / "config.json") in lines[0], res.output
    assert "weight_block_size" in lines[0] and not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "option, value",
    [
        ("--max-shard-size", "0"),
        ("--max-shard-size", "-5GB"),
        ("--max-shard-size", "nan"),
        ("--max-shard-size", "0.5B"),
        ("--max-memory", "0"),
        ("--max-memory", "inf"),
        ("--max-memory", "0.1B"),
        ("--workers", "0"),
        ("--workers", "-2"),
    ],
)
def test_numeric_options_that_mean_nothing_are_refused(tiny_vendor, tmp_path, option, value):
    res = CliRunner().invoke(
        cli, ["convert", str(tiny_vendor), "--output", str(tmp_path / "o"), option, value]
    )
    assert res.exit_code == 2 and option in res.output and not (tmp_path / "o").exists(), res.output
