"""Nothing porter reads may crash it or make it read outside the folder: every malformed, misplaced or
non-regular file is a porter error naming the file (exit 2 on the CLI), in runtime.load and the commands."""

import builtins
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import porter
import runtime
from porter.cli import main as porter_cli
from porter.errors import EXIT_BAD_INPUT, PorterError

INDEX = "model.safetensors.index.json"
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def artifact(tiny_vendor, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile") / "art"
    porter.convert(tiny_vendor, d, progress=False)
    return d


def copy(src: Path, root: Path) -> Path:
    """src copied to root/m, with a sentinel file beside it (outside the folder) that must never be opened."""
    d = root / "m"
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(src, d)
    (root / "sentinel.safetensors").write_bytes(b"outside")
    return d


class Opens:
    """Records every path opened through builtins.open / os.open / io.open."""

    def __init__(self, monkeypatch):
        self.paths = []
        real_open, real_os_open = builtins.open, os.open

        def rec_open(f, *a, **k):
            if isinstance(f, (str, Path)):
                self.paths.append(os.path.realpath(f))
            return real_open(f, *a, **k)

        def rec_os_open(f, *a, **k):
            self.paths.append(os.path.realpath(f))
            return real_os_open(f, *a, **k)

        monkeypatch.setattr(builtins, "open", rec_open)
        monkeypatch.setattr(os, "open", rec_os_open)

    def outside(self, folder: Path) -> list:
        root = os.path.realpath(folder)

        def ours(p):  # the folder itself, or Python's own modules (imports happen during load)
            return p.startswith(root + os.sep) or "site-packages" in p or "/lib/python" in p

        return [p for p in self.paths if "sentinel" in p or not ours(p)]


def load_error(d: Path) -> str:
    with pytest.raises(PorterError) as e:
        runtime.load(d)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(porter_cli, list(map(str, args)))
    return res.exit_code, res.output


def set_weight_map(d: Path, value) -> None:
    doc = json.loads((d / INDEX).read_text())
    name = sorted(doc["weight_map"])[0]
    doc["weight_map"][name] = value
    (d / INDEX).write_text(json.dumps(doc))


@pytest.mark.parametrize("entry", ["../sentinel.safetensors", "ABS", "link.safetensors"])
def test_index_cannot_name_files_outside(artifact, tmp_path, entry):
    d = copy(artifact, tmp_path)
    if entry == "ABS":
        entry = str(tmp_path / "sentinel.safetensors")
    if entry == "link.safetensors":
        os.symlink(tmp_path / "sentinel.safetensors", d / entry)
    set_weight_map(d, entry)
    msg = load_error(d)
    assert "outside" in msg and INDEX in msg


@pytest.mark.parametrize(
    "case",
    [
        "truncated_shard",
        "index_missing_tensor",
        "index_not_json",
        "manifest_list",
        "config_not_utf8",
        "index_shape",
        "options_list",
    ],
)
def test_malformed_files_are_named(artifact, tmp_path, case):
    d = copy(artifact, tmp_path)
    shard = next(d.glob("*.safetensors"))
    culprit = {
        "truncated_shard": shard.name,
        "index_missing_tensor": INDEX,
        "index_not_json": INDEX,
        "manifest_list": "porter.json",
        "config_not_utf8": "config.json",
        "index_shape": INDEX,
        "options_list": "porter.json",
    }[case]
    if case == "truncated_shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif case == "index_missing_tensor":
        set_weight_map(d, shard.name)
        doc = json.loads((d / INDEX).read_text())
        doc["weight_map"]["model.no_such.weight"] = shard.name
        (d / INDEX).write_text(json.dumps(doc))
    elif case == "index_not_json":
        (d / INDEX).write_text("{not json")
    elif case == "manifest_list":
        (d / "porter.json").write_text("[1, 2]")
    elif case == "config_not_utf8":
        (d / "config.json").write_bytes(b"\xff\xfe{}")
    elif case == "index_shape":
        (d / INDEX).write_text(json.dumps({"weight_map": [1, 2]}))
    elif case == "options_list":
        doc = json.loads((d / "porter.json").read_text())
        doc["options"] = [1]
        (d / "porter.json").write_text(json.dumps(doc))
    assert culprit in load_error(d)
    code, out = cli("inspect", d)
    assert code == EXIT_BAD_INPUT, out
    assert out.count("\n") == 1 and culprit in out


@pytest.mark.parametrize("kind", ["dir", "fifo", "loop"])
@pytest.mark.parametrize("name", ["tokenizer.json", "generation_config.json", "config.json", INDEX])
def test_non_regular_files_refused_without_blocking(artifact, tmp_path, kind, name):
    d = copy(artifact, tmp_path)
    p = d / name
    p.unlink()
    {"dir": p.mkdir, "fifo": lambda: os.mkfifo(p), "loop": lambda: os.symlink(p.name, p)}[kind]()
    msg = load_error(d)  # a FIFO opened would block this test forever
    assert name in msg


def test_source_index_outside_refused(tiny_vendor, tmp_path):
    d = copy(tiny_vendor, tmp_path)
    set_weight_map(d, "../sentinel.safetensors")
    assert "outside" in load_error(d)
    code, out = cli("convert", d, "--output", tmp_path / "o")
    assert code == EXIT_BAD_INPUT and "outside" in out, out


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()


def containers(c):
    return st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3)


json_values = st.recursive(scalars, containers, max_leaves=8)


def check_load_never_escapes(d: Path, monkeypatch):
    with monkeypatch.context() as m:
        opens = Opens(m)
        try:
            runtime.load(d)
        except PorterError as e:
            assert "\n" not in str(e)
        assert opens.outside(d) == []


@FUZZ
@given(
    name=st.sampled_from(
        ["config.json", INDEX, "porter.json", "generation_config.json", "tokenizer_config.json"]
    ),
    value=json_values,
)
def test_fuzz_json_shapes(artifact, tmp_path_factory, monkeypatch, name, value):
    d = copy(artifact, tmp_path_factory.mktemp("fz"))
    (d / name).write_text(json.dumps(value))
    check_load_never_escapes(d, monkeypatch)


@FUZZ
@given(
    entry=st.one_of(
        st.text(max_size=20),
        st.sampled_from(
            [
                "..",
                "../sentinel.safetensors",
                "/etc/passwd",
                "./../m/x.safetensors",
                "link.safetensors",
                "sub/../../sentinel.safetensors",
            ]
        ),
        json_values,
    )
)
def test_fuzz_weight_map_entries(artifact, tmp_path_factory, monkeypatch, entry):
    root = tmp_path_factory.mktemp("fz")
    d = copy(artifact, root)
    os.symlink(root / "sentinel.safetensors", d / "link.safetensors")
    set_weight_map(d, entry)
    check_load_never_escapes(d, monkeypatch)


@FUZZ
@given(cut=st.integers(0, 4096), noise=st.binary(max_size=64), at=st.integers(0, 256))
def test_fuzz_shard_header_bytes(artifact, tmp_path_factory, monkeypatch, cut, noise, at):
    d = copy(artifact, tmp_path_factory.mktemp("fz"))
    shard = next(d.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[at : at + len(noise)] = noise
    shard.write_bytes(bytes(raw[: len(raw) - cut] if cut else raw))
    check_load_never_escapes(d, monkeypatch)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.sampled_from(
        [
            "config.json",
            INDEX,
            "porter.json",
            "generation_config.json",
            "tokenizer_config.json",
            "tokenizer.json",
        ]
    ),
    value=json_values,
)
def test_fuzz_cli_exit_codes(artifact, tiny_vendor, tmp_path_factory, name, value):
    d = copy(artifact, tmp_path_factory.mktemp("fz"))
    (d / name).write_text(json.dumps(value))
    for args in (
        ["inspect", d],
        ["generate", d, "--prompt", "hi", "--max-new-tokens", "1"],
        ["verify", d, "--reference", tiny_vendor, "--max-new-tokens", "0"],
    ):
        code, out = cli(*args)
        ok = (0, 1, EXIT_BAD_INPUT) if args[0] == "verify" else (0, EXIT_BAD_INPUT)  # 1: not faithful
        assert code in ok, (args, out)


def test_verify_manifest_shard_outside_refused(artifact, tiny_vendor, tmp_path):
    d = copy(artifact, tmp_path)
    doc = json.loads((d / "porter.json").read_text())
    first = sorted(doc["shards"])[0]
    doc["shards"]["../sentinel.safetensors"] = doc["shards"].pop(first)
    (d / "porter.json").write_text(json.dumps(doc))
    code, out = cli("verify", d, "--reference", tiny_vendor, "--max-new-tokens", "0")
    assert code == EXIT_BAD_INPUT and "outside" in out and out.count("\n") == 1, out


@pytest.mark.parametrize("kind", ["not_utf8", "fifo"])
def test_verify_broken_config_is_a_finding_not_a_crash(artifact, tiny_vendor, tmp_path, kind):
    d = copy(artifact, tmp_path)
    (d / "config.json").unlink()
    if kind == "fifo":
        os.mkfifo(d / "config.json")
    else:
        (d / "config.json").write_bytes(b"\xff{}")
    code, out = cli("verify", d, "--reference", tiny_vendor, "--max-new-tokens", "0")
    assert code == 1 and "config.json" in out, out  # not faithful: the artifact's config is damaged


def test_broken_tokenizer_and_non_utf8_prompt(artifact, tiny_vendor, tmp_path):
    d = copy(artifact, tmp_path)
    code, out = cli("generate", d, "--prompt", "\udcff", "--max-new-tokens", "1")
    assert code == EXIT_BAD_INPUT and "UTF-8" in out, out
    (d / "tokenizer.json").write_text('{"model": 3}')
    for args in (
        ["generate", d, "--prompt", "hi", "--max-new-tokens", "1"],
        ["verify", d, "--reference", tiny_vendor, "--max-new-tokens", "0"],
    ):
        code, out = cli(*args)
        assert code == EXIT_BAD_INPUT and "tokenizer.json" in out, out


@pytest.mark.parametrize("journal", ["[1]", '"x"', "\xff"])
def test_convert_journal_of_wrong_shape(tiny_vendor, tmp_path, journal):
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    (out_dir / ".porter-journal.json").write_bytes(journal.encode("latin-1"))
    code, out = cli("convert", tiny_vendor, "--output", out_dir, "--resume")
    assert code == EXIT_BAD_INPUT, out


@FUZZ
@given(
    name=st.sampled_from(["config.json", INDEX]),
    entry=st.one_of(
        st.sampled_from(["../sentinel.safetensors", "/etc/passwd", "link.safetensors"]), json_values
    ),
)
def test_fuzz_source_files(tiny_vendor, tmp_path_factory, monkeypatch, name, entry):
    root = tmp_path_factory.mktemp("fz")
    d = copy(tiny_vendor, root)
    os.symlink(root / "sentinel.safetensors", d / "link.safetensors")
    if name == INDEX:
        set_weight_map(d, entry)
    else:
        (d / name).write_text(json.dumps(entry))
    check_load_never_escapes(d, monkeypatch)


@pytest.mark.parametrize("kind", ["dir", "fifo", "loop"])
def test_convert_refuses_non_regular_source_files(tiny_vendor, tmp_path, kind):
    d = copy(tiny_vendor, tmp_path)
    p = d / "generation_config.json"
    p.unlink()
    {"dir": p.mkdir, "fifo": lambda: os.mkfifo(p), "loop": lambda: os.symlink(p.name, p)}[kind]()
    code, out = cli("convert", d, "--output", tmp_path / "o")
    assert code == EXIT_BAD_INPUT and "generation_config.json" in out and out.count("\n") == 1, out
    assert not (tmp_path / "o" / "porter.json").exists()


# ---------------------------------------------------------------------------------------------------------
# Sizes, context and token ids: what a config or a call asks for is checked against what the files and the
# model hold, before any loop or allocation is made from it.


@pytest.fixture(scope="module")
def artifact_hf(tiny_vendor, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile") / "art_hf"
    porter.convert(tiny_vendor, d, progress=False, layout="hf")
    return d


def one_error(out: str) -> bool:
    """The output (log lines aside) is one `porter: error:` line, no traceback."""
    return [
        line.startswith("porter: error: ") for line in out.splitlines() if line.startswith("porter:")
    ] == [True] and "Traceback" not in out


def set_config(d: Path, key: str, value) -> None:
    """config.json's field at `key` ('text_config.sparse_attention_config.x' or a top-level name) = value."""
    doc = json.loads((d / "config.json").read_text())
    *path, last = key.split(".")
    node = doc
    for part in path:
        node = node[part]
    node[last] = value
    (d / "config.json").write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def m2_sources(tmp_path_factory) -> dict:
    """MiniMax-M2 fixtures: the FP8-block release layout, bf16 under its names, transformers' fused names,
    and an artifact converted from the release."""
    from minimax_m2_tiny_checkpoint import build_m2_checkpoint as build_m2

    root = tmp_path_factory.mktemp("m2")
    out = {layout: build_m2(root / layout, layout=layout) for layout in ("fp8", "vendor", "transformers")}
    out["artifact"] = root / "art"
    porter.convert(out["fp8"], out["artifact"], progress=False)
    return out


@pytest.fixture(scope="module")
def gpt_oss_sources(tmp_path_factory) -> dict:
    """gpt-oss fixtures: OpenAI's MXFP4 release layout, transformers' bf16 layout, and an artifact."""
    from gpt_oss_tiny_checkpoint import build_tiny_checkpoint as build_gpt_oss

    root = tmp_path_factory.mktemp("go")
    out = {layout: build_gpt_oss(root / layout, layout=layout) for layout in ("mxfp4", "bf16")}
    out["artifact"] = root / "art"
    porter.convert(out["mxfp4"], out["artifact"], progress=False)
    return out


TARGETS = [
    "vendor",
    "transformers",
    "artifact",
    "artifact_hf",
    "m2:fp8",
    "m2:vendor",
    "m2:transformers",
    "m2:artifact",
    "go:mxfp4",
    "go:bf16",
    "go:artifact",
]


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    pick=st.integers(0, 63),
    change=st.sampled_from([lambda v: 10**9, lambda v: 10**18, lambda v: v + 1, lambda v: 2 * v]),
    target=st.sampled_from(TARGETS),
)
def test_config_sizes_are_checked_against_the_files(request, tmp_path_factory, pick, change, target):
    """Any size field of any family changed (absurdly or by one), in every source and output layout:
    runtime.load, inspect and convert (sources) or generate (artifacts) refuse in well under a second with
    one line naming the field, its value and what the files hold, before anything is planned, allocated or
    written. (A field the files may hold more of, such as M2's MTP module count, bounds nothing and is not
    changed.)"""
    import converters

    if target.startswith(("m2:", "go:")):
        src = request.getfixturevalue({"m2": "m2_sources", "go": "gpt_oss_sources"}[target[:2]])[target[3:]]
    else:
        src = request.getfixturevalue(
            {"vendor": "tiny_vendor", "transformers": "tiny_transformers"}.get(target, target)
        )
    root = tmp_path_factory.mktemp("sz")
    d = copy(src, root)
    raw = json.loads((d / "config.json").read_text())
    conv = converters.for_config(raw)
    extras = {r.extra for r in conv.SIZE_RULES if getattr(r, "extra", "")}
    fields = sorted(f for f in conv.config_sizes(raw) if f not in extras)
    value, key = conv.config_sizes(raw)[fields[pick % len(fields)]]
    set_config(d, key, change(value))
    t0 = time.monotonic()
    msg = load_error(d)
    assert time.monotonic() - t0 < 1.0
    assert (
        "config field" in msg
        and repr(key) in msg
        and "this config.json does not describe these weights" in msg
    ), msg
    artifact = "artifact" in target
    commands = [["inspect", d]]
    commands.append(
        ["generate", d, "--prompt", "hi", "--max-new-tokens", "1"]
        if artifact
        else ["convert", d, "--output", root / "o"]
    )
    for args in commands:
        code, out = cli(*args)
        assert code == EXIT_BAD_INPUT and one_error(out) and repr(key) in out, (args, out)
    assert not (root / "o").exists()


@pytest.mark.parametrize("name", ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"])
def test_index_lacking_a_tensor_the_model_needs(artifact, tmp_path, name):
    d = copy(artifact, tmp_path)
    doc = json.loads((d / INDEX).read_text())
    del doc["weight_map"][name]
    (d / INDEX).write_text(json.dumps(doc))
    for lazy in (False, True):
        with pytest.raises(PorterError) as e:
            runtime.load(d, lazy=lazy)
        assert f"tensor {name!r} is missing from {d / INDEX}" in str(e.value)
    code, out = cli("generate", d, "--prompt", "hi", "--max-new-tokens", "1")
    assert code == EXIT_BAD_INPUT and name in out and INDEX in out and one_error(out), out


@pytest.fixture(scope="module")
def short_context(artifact, tmp_path_factory) -> Path:
    """The artifact with a 12-token context, so that generating up to it is cheap."""
    d = copy(artifact, tmp_path_factory.mktemp("ctx"))
    set_config(d, "text_config.max_position_embeddings", 12)
    return d


def test_generation_beyond_the_context_exits_2_naming_the_numbers(artifact):
    code, out = cli("generate", artifact, "--prompt", "hi", "--max-new-tokens", "1000000000")
    assert code == EXIT_BAD_INPUT and one_error(out), out
    assert "max_new_tokens (1,000,000,000)" in out and "context of 4,096 tokens" in out, out


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompt_len=st.integers(1, 16), new=st.none() | st.integers(0, 16), as_tensor=st.booleans())
def test_prompt_and_new_tokens_inside_the_context(short_context, prompt_len, new, as_tensor):
    """Within the 12-token context the call generates; beyond it, a max_new_tokens the call gave is refused
    naming both numbers and the limit, a default one is shortened to fit, and a prompt that fills the
    context is refused. The KV cache never holds more than the context."""
    import torch

    model = _context_model(short_context)
    ids = [(7 * i) % 300 + 3 for i in range(prompt_len)]
    prompt = torch.tensor([ids]) if as_tensor else ids
    default = model.generation_config.max_new_tokens
    n = default if new is None else new
    if prompt_len > 12 or (prompt_len == 12 and n > 0) or (new is not None and prompt_len + new > 12):
        with pytest.raises(PorterError) as e:
            model.generate(prompt, new, eos_token_id=[])
        msg = str(e.value)
        assert "context of 12" in msg and f"{prompt_len:,} tokens" in msg and "\n" not in msg, msg
        return
    out = model.generate(prompt, new, eos_token_id=[])
    got = (out.shape[1] if as_tensor else len(out)) - prompt_len
    assert got == min(n, 12 - prompt_len)


_MODELS: dict = {}


def _context_model(path):
    if path not in _MODELS:
        _MODELS[path] = runtime.load(path)
    return _MODELS[path]


def test_kv_cache_larger_than_free_memory_is_refused(artifact, tmp_path, monkeypatch):
    """The cache is sized from what the call can reach and checked against the memory free for it: a config
    whose index blocks are a billion tokens long is refused before anything is allocated."""
    import runtime.generate as generate

    model = runtime.load(artifact)
    monkeypatch.setattr(generate, "free_bytes", lambda device: 1 << 10)
    with pytest.raises(
        PorterError, match=r"KV cache for 1 x 4 tokens needs 0.01 MiB on cpu, which has 0.00 MiB free"
    ):
        model.generate([5, 6], 2)
    monkeypatch.undo()
    d = copy(artifact, tmp_path)
    set_config(d, "text_config.sparse_attention_config.sparse_block_size", 10**9)
    code, out = cli("generate", d, "--prompt", "hi", "--max-new-tokens", "2")
    assert code == EXIT_BAD_INPUT and "KV cache" in out and one_error(out), out


def test_token_ids_beyond_the_vocabulary(artifact, tmp_path):
    model = _context_model(artifact)
    for bad in ([5, 384], [-1, 5]):
        with pytest.raises(
            PorterError,
            match=f"token id {bad[1] if bad[0] == 5 else -1} is outside the model's vocabulary of 384",
        ):
            model.generate(bad, 1)
    d = copy(artifact, tmp_path)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(["<beyond>"])  # id 384: a tokenizer that does not belong to this 384-token model
    tok.save(str(d / "tokenizer.json"))
    code, out = cli("generate", d, "--prompt", "a <beyond> b", "--max-new-tokens", "1")
    assert code == EXIT_BAD_INPUT and "gives token id 384" in out and "tokenizer.json" in out, out
    d = copy(artifact, tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 10**6}))
    code, out = cli("generate", d, "--prompt", "hi", "--max-new-tokens", "1")
    assert code == EXIT_BAD_INPUT and "pad token id 1000000" in out, out


@pytest.mark.parametrize(
    "device_map, max_memory, culprit",
    [
        ({"layers.0": "disk", "layers.1": "cpu", "layers.2": "cpu", "layers.3": "cpu"}, None, "'disk'"),
        ({f"layers.{i}": "meta" for i in range(4)}, None, "'meta'"),
        ({f"layers.{i}": -1 for i in range(4)}, None, "-1"),
        ({f"layers.{i}": None for i in range(4)}, None, "None"),
        ("disk", None, "'disk'"),
        ({f"layers.{i}": "cuda:7" for i in range(4)}, None, "cuda:7"),
        ("auto", {"disk": "1GB"}, "'disk'"),
        ("auto", {"cpu": float("nan")}, "nan"),
        ("auto", {"cpu": -5}, "-5"),
        ("auto", ["cpu"], "max_memory must be a dict"),
    ],
)
def test_device_map_values_are_refused_in_one_line(artifact, device_map, max_memory, culprit):
    with pytest.raises(PorterError) as e:
        runtime.load(artifact, device_map=device_map, max_memory=max_memory)
    assert culprit in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_verify_checks_both_configs_sizes_against_their_files(artifact, tiny_vendor, tmp_path):
    """The reference's config is input (exit 2); the artifact's is what verify judges (exit 1, the field
    named). Neither is resolved into per-layer lists of a billion entries first: the artifact's config here
    has no per-layer lists, so resolving it unchecked would build two lists of 10**9 (16 GB)."""
    ref = copy(tiny_vendor, tmp_path / "r")
    set_config(ref, "text_config.num_local_experts", 10**9)
    code, out = cli("verify", artifact, "--reference", ref, "--max-new-tokens", "0")
    assert (
        code == EXIT_BAD_INPUT and "'text_config.num_local_experts' = 1,000,000,000" in out and one_error(out)
    )
    art = copy(artifact, tmp_path / "a")
    doc = json.loads((art / "config.json").read_text())
    text = doc["text_config"]
    text.pop("moe_layer_freq")
    text["sparse_attention_config"].pop("sparse_attention_freq")
    text["num_hidden_layers"] = 10**9
    (art / "config.json").write_text(json.dumps(doc))
    t0 = time.monotonic()
    code, out = cli("verify", art, "--reference", tiny_vendor, "--max-new-tokens", "0")
    assert (
        code == 1
        and "config.json resolves num_hidden_layers = 1000000000 but porter.json resolved_config says 4"
        in out
    )
    assert time.monotonic() - t0 < 30


def _as_snapshot(artifact: Path, root: Path, sha: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """The artifact laid out as a Hugging Face cache keeps it: repo/snapshots/<sha>/<file> -> repo/blobs/<file>."""
    repo = root / "models--o--r"
    snap, blobs = repo / "snapshots" / sha, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in artifact.iterdir():
        shutil.copy2(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    return snap


@pytest.mark.parametrize(
    "entry", ["../../outside.safetensors", "../other/x.safetensors", "../../blobs/../outside.safetensors"]
)
def test_snapshot_folder_index_cannot_escape(artifact, tmp_path, entry):
    """A folder under .../snapshots/<sha>/ may name only its own files (which may link into the repo's
    blobs/), never another path in the cache: `../` out of the snapshot is refused."""
    snap = _as_snapshot(artifact, tmp_path)
    assert runtime.load(snap).cfg.num_hidden_layers == 4  # links into blobs/ are the snapshot's own files
    repo = snap.parent.parent
    shard = sorted(artifact.glob("model-*.safetensors"))[0]
    for target in (repo / "outside.safetensors", snap.parent / "other" / "x.safetensors"):
        target.parent.mkdir(exist_ok=True)
        shutil.copy2(shard, target)
    index = json.loads((snap / INDEX).read_text())
    index["weight_map"] = {n: (entry if f == shard.name else f) for n, f in index["weight_map"].items()}
    (snap / INDEX).unlink()
    (snap / INDEX).write_text(json.dumps(index))
    msg = load_error(snap)
    assert "points outside" in msg and entry in msg


# ---------------------------------------------------------------------------------------------------
# porter verify writes its report and picture only outside the artifact and the reference


def _hashes(*folders) -> dict:
    return {str(p): p.read_bytes() for d in folders for p in sorted(Path(d).rglob("*")) if p.is_file()}


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    option=st.sampled_from(["--report", "--plot"]),
    where=st.sampled_from(
        ["artifact/porter.json", f"artifact/{INDEX}", "artifact/new.svg", "reference/config.json", "link.svg"]
    ),
)
def test_verify_never_writes_into_the_artifact_or_the_reference(
    artifact, tiny_vendor, tmp_path_factory, option, where
):
    """--report / --plot naming a file inside the artifact or the reference (spelled out, or through a
    symlink elsewhere that points in): exit 2 naming the option, every file of both folders unchanged."""
    root = tmp_path_factory.mktemp("reportpath")
    art, ref = (
        Path(shutil.copytree(artifact, root / "artifact")),
        Path(shutil.copytree(tiny_vendor, root / "reference")),
    )
    if where == "link.svg":
        (root / "link.svg").symlink_to(art / "porter.json")
    before = _hashes(art, ref)
    path = root / where
    code, out = cli("verify", art, "--reference", ref, option, path, "--max-new-tokens", 0)
    assert code == EXIT_BAD_INPUT and len(out.strip().splitlines()) == 1, out
    assert f"{option} {path}: inside the" in out and "Traceback" not in out
    assert _hashes(art, ref) == before


def test_verify_refuses_a_reference_of_another_commit(artifact, tiny_vendor, tmp_path):
    """porter.json names the source commit: a reference that is another commit (a snapshot folder names
    its own), or a folder that cannot show any commit, is refused naming both; the same commit passes."""
    from porter.commands.verify.inputs import check_reference_commit

    art = Path(shutil.copytree(artifact, tmp_path / "art"))
    a, b = "a" * 40, "b" * 40
    doc = json.loads((art / "porter.json").read_text())
    doc["source"]["commit"] = a
    (art / "porter.json").write_text(json.dumps(doc))
    other = tmp_path / "models--o--r" / "snapshots" / b
    shutil.copytree(tiny_vendor, other)
    for ref, want in (
        (other, f"is commit {b}, but porter.json says the artifact was converted from commit {a}"),
        (tiny_vendor, "not a Hugging Face snapshot that shows its commit"),
    ):
        code, out = cli("verify", art, "--reference", ref, "--max-new-tokens", 0)
        assert code == EXIT_BAD_INPUT and want in out and len(out.strip().splitlines()) == 1, out
    same = tmp_path / "models--o--r" / "snapshots" / a
    shutil.copytree(tiny_vendor, same)
    check_reference_commit(doc, same)  # the named commit: no objection
