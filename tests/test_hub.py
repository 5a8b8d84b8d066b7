"""porter convert / verify against a real Hugging Face hub server on localhost (olah; tests/hub_server.py):
huggingface_hub's own HTTP code resolves revisions, lists and fetches files. docs/hub.md lists the endpoints.
"""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hub_server import LICENSE_TEXT, MODEL_CARD, TAG, UNUSED_FILES

from porter.cli import main
from porter.format.model_card import SECTION_TITLE
from porter.version import __version__

pytestmark = pytest.mark.hub
REPO = "MiniMaxAI/Tiny-M3"
SHARD = "model-00002-of-00004.safetensors"


def porter(*args):
    return CliRunner().invoke(main, ["-q", *map(str, args)])


def one_line_error(res) -> str:
    """The CLI's answer to bad input: exit 2 and one `porter: error:` line, last (before it at most
    huggingface_hub's own warnings, e.g. that it retries a download), no traceback."""
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and lines[-1].startswith("porter: error: "), res.output
    assert sum(ln.startswith("porter:") for ln in lines) == 1 and "Traceback" not in res.output, res.output
    return lines[-1]


def fetched(hub, since: int = 0) -> set:
    """Repo files whose bytes were requested (GET .../resolve/<rev>/<file>)."""
    return {
        r.path.split("/resolve/", 1)[1].split("/", 1)[1]
        for r in hub.gate.requests[since:]
        if r.method == "GET" and "/resolve/" in r.path
    }


def snapshot(cache: Path, repo_id: str, commit: str) -> Path:
    return cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit


def assert_same_files(a: Path, b: Path, names) -> None:
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def test_convert_and_verify_from_the_hub(hub, tmp_path):
    repo = hub.repos[REPO]
    out = tmp_path / "out"
    res = porter("convert", REPO, "--output", out)
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "porter.json").read_text())
    assert doc["source"]["repo_id"] == REPO and doc["source"]["commit"] == repo.main  # `main` -> its commit
    assert hub.gate.gets(f"/api/models/{REPO}/revision/main")
    # allow_patterns: everything a conversion reads, nothing else in the repo
    assert fetched(hub) == set(repo.files) - set(UNUSED_FILES)
    shards = sorted(f for f in repo.files if f.startswith("model-"))
    assert_same_files(snapshot(hub.cache, REPO, repo.main), repo.folder, shards)
    assert (out / "LICENSE").read_bytes() == LICENSE_TEXT.encode()

    # verify on another machine: the recorded snapshot path is gone, the reference comes by repo id + commit
    doc["source"]["path"] = "/nonexistent/snapshot"
    (out / "porter.json").write_text(json.dumps(doc))
    since = len(hub.gate.requests)
    res = porter("verify", out, "--max-new-tokens", "2", "--cache-dir", tmp_path / "verify-cache")
    assert res.exit_code == 0 and "PASS" in res.output, res.output
    assert fetched(hub, since) >= set(shards)
    assert_same_files(snapshot(tmp_path / "verify-cache", REPO, repo.main), repo.folder, shards)


def test_revision_as_a_tag(hub, tmp_path):
    repo = hub.repos[REPO]
    assert repo.tagged != repo.main
    out = tmp_path / "out"
    res = porter("convert", REPO, "--revision", TAG, "--output", out)
    assert res.exit_code == 0, res.output
    assert json.loads((out / "porter.json").read_text())["source"]["commit"] == repo.tagged
    assert hub.gate.gets(f"/api/models/{REPO}/revision/{TAG}")
    assert {r.path.split("/resolve/")[1].split("/")[0] for r in hub.gate.gets("/resolve/")} == {repo.tagged}
    card = (out / "README.md").read_text()
    assert card.startswith(MODEL_CARD + "\n" + SECTION_TITLE)  # the card as tagged, not main's revision
    assert f"at commit `{repo.tagged}`" in card and f"porter {__version__}" in card


def test_transformers_layout_repo(hub, tmp_path):
    repo = hub.repos["MiniMaxAI/Tiny-M3-HF"]
    res = porter("convert", repo.repo_id, "--output", tmp_path / "out")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "out" / "porter.json").read_text())
    assert doc["source"]["commit"] == repo.main
    assert fetched(hub) == set(repo.files) - set(UNUSED_FILES)


def test_dry_run_reads_shard_headers_only(hub, tmp_path):
    repo = hub.repos[REPO]
    res = CliRunner().invoke(main, ["convert", REPO, "--output", str(tmp_path / "out"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "out").exists()
    shard_gets = [r for r in hub.gate.gets("/resolve/") if r.path.endswith(".safetensors")]
    assert shard_gets and all(r.headers.get("range", "").startswith("bytes=0-") for r in shard_gets)
    assert not list(snapshot(hub.cache, REPO, repo.main).glob("model-*.safetensors"))  # no shard downloaded
    assert "model-00001-of-00001.safetensors" in res.output  # the planned output shard


@pytest.mark.parametrize(
    "args, names",
    [
        (["MiniMaxAI/No-Such-Repo"], ["MiniMaxAI/No-Such-Repo"]),
        ([REPO, "--revision", "no-such-tag"], [REPO, "no-such-tag"]),
    ],
)
def test_unknown_repo_or_revision(hub, tmp_path, args, names):
    """olah answers both with 401 RepoNotFound (the public hub: 404 / RevisionNotFound); either way one line
    naming the repo and the revision."""
    line = one_line_error(porter("convert", *args, "--output", tmp_path / "out"))
    assert all(n in line for n in names), line
    assert not (tmp_path / "out").exists()


def test_gated_repo(hub, tmp_path):
    hub.gate.gate(REPO)  # olah cannot emulate a gated repo: the gate answers as the hub does
    line = one_line_error(porter("convert", REPO, "--output", tmp_path / "out"))
    assert REPO in line and "gated" in line and "--token" in line


def test_pickle_only_repo_refused_before_download(hub, tmp_path):
    line = one_line_error(porter("convert", "MiniMaxAI/Tiny-M3-Pickle", "--output", tmp_path / "out"))
    assert "only pickle weights" in line
    assert hub.gate.gets("/api/models/MiniMaxAI/Tiny-M3-Pickle/tree/")  # the file listing
    assert "pytorch_model.bin" not in fetched(hub)


def test_token_and_cache_dir_options(hub, tmp_path):
    repo, cache = hub.repos[REPO], tmp_path / "my-cache"
    res = porter(
        "convert", REPO, "--output", tmp_path / "out", "--token", "hf_porter_test", "--cache-dir", cache
    )
    assert res.exit_code == 0, res.output
    assert hub.gate.requests and all(
        r.headers.get("authorization") == "Bearer hf_porter_test"
        for r in hub.gate.requests
        if "/MiniMaxAI/" in r.path
    )
    assert snapshot(cache, REPO, repo.main).is_dir() and not hub.cache.exists()  # HF_HOME's cache untouched

    doc = json.loads((tmp_path / "out" / "porter.json").read_text())
    doc["source"]["path"] = "/nonexistent/snapshot"
    (tmp_path / "out" / "porter.json").write_text(json.dumps(doc))
    hub.gate.reset()
    res = porter(
        "verify",
        tmp_path / "out",
        "--max-new-tokens",
        "0",
        "--token",
        "hf_verify_test",
        "--cache-dir",
        tmp_path / "verify-cache",
    )
    assert res.exit_code == 0, res.output
    api = [r for r in hub.gate.requests if "/MiniMaxAI/" in r.path]
    assert api and all(r.headers.get("authorization") == "Bearer hf_verify_test" for r in api)
    assert snapshot(tmp_path / "verify-cache", REPO, repo.main).is_dir()


def test_no_token_sent_without_one(hub, tmp_path):
    res = porter("convert", REPO, "--output", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert not any("authorization" in r.headers for r in hub.gate.requests)


def test_download_cut_mid_file_is_retried_with_a_range_request(hub, tmp_path, monkeypatch):
    """The connection dies halfway through a shard; huggingface_hub asks again from the last whole chunk it
    wrote. olah ignores Range and sends the whole file (200), which the client restarts from: the same bytes
    either way. Chunks of 16 KiB (not 10 MB) so that a tiny shard has written some before the cut."""
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "DOWNLOAD_CHUNK_SIZE", 16384)
    repo = hub.repos[REPO]
    size = (repo.folder / SHARD).stat().st_size
    hub.gate.cut_after(SHARD, size // 2, down=None)
    res = porter("convert", REPO, "--output", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert hub.gate.cuts_done == 1
    first, retry = [r.headers.get("range") for r in hub.gate.gets(SHARD)]
    resumed_at = int(retry.removeprefix("bytes=").removesuffix("-"))
    assert first is None and 0 < resumed_at <= size // 2 and resumed_at % 16384 == 0, retry
    assert_same_files(snapshot(hub.cache, REPO, repo.main), repo.folder, [SHARD])


@pytest.mark.parametrize("down", ["503", "drop"])
def test_hub_down_mid_download_then_rerun_completes(hub, tmp_path, down):
    """The hub goes down halfway through a shard (then answers 503, or drops every connection as a killed
    server does, which huggingface_hub retries 5 times a second apart): one line, exit 2. The rerun fetches
    only what is missing and the cache ends with the repo's exact bytes."""
    repo = hub.repos[REPO]
    size = (repo.folder / SHARD).stat().st_size
    hub.gate.cut_after(SHARD, size // 3, down=down)
    out = tmp_path / "out"
    line = one_line_error(porter("convert", REPO, "--output", out))
    assert REPO in line and "download failed" in line and "retry" in line
    assert hub.gate.cuts_done == 1
    snap = snapshot(hub.cache, REPO, repo.main)
    kept = {p.name for p in snap.iterdir() if p.exists()}
    assert SHARD not in kept and "config.json" in kept
    assert not any(p.name.endswith(".incomplete") for p in hub.cache.rglob("*"))  # no torn file left behind

    hub.gate.reopen()
    since = len(hub.gate.requests)
    res = porter("convert", REPO, "--output", out, "--resume")
    assert res.exit_code == 0, res.output
    again = fetched(hub, since)
    assert SHARD in again and not again & kept  # finished files are not fetched again
    shards = sorted(f for f in repo.files if f.startswith("model-"))
    assert_same_files(snap, repo.folder, shards)
    assert json.loads((out / "porter.json").read_text())["source"]["commit"] == repo.main


def test_cli_subprocess_uses_the_environment(hub, tmp_path):
    """HF_ENDPOINT / HF_HOME from the environment, as a user's shell gives them (no patched constants)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "porter.cli",
            "-q",
            "convert",
            REPO,
            "--output",
            str(tmp_path / "out"),
            "--workers",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "out" / "porter.json").read_text())
    assert doc["source"]["commit"] == hub.repos[REPO].main
    assert snapshot(Path(env["HF_HOME"]) / "hub", REPO, hub.repos[REPO].main).is_dir()


def test_hub_unreachable(hub, tmp_path, monkeypatch):
    """Nothing listens at HF_ENDPOINT and nothing is cached: one line saying so."""
    import huggingface_hub.constants as c
    from hub_server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(c, "ENDPOINT", url)
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    line = one_line_error(porter("convert", REPO, "--output", tmp_path / "out"))
    assert REPO in line and "cannot be reached" in line
