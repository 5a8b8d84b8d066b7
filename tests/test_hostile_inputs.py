"""Nothing porter reads may crash it or make it read outside the folder: every malformed, misplaced or
non-regular file is a porter error naming the file (exit 2 on the CLI), in runtime.load and the commands."""

import builtins
import json
import os
import shutil
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
