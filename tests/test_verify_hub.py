"""porter verify finds its reference through the Hugging Face cache when the artifact came from a repo id
(a local path or the Hugging Face cache); offline, from a hand-made cache."""

import json
import shutil

import pytest
from click.testing import CliRunner

import porter
from porter.cli import main

SHA = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture()
def hub_artifact(tiny_vendor, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    cache = tmp_path / "hub"
    repo = cache / "models--MiniMaxAI--Tiny-M3"
    shutil.copytree(tiny_vendor, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    out = tmp_path / "art"
    porter.convert("MiniMaxAI/Tiny-M3", out, progress=False)
    return out


def run(*args):
    return CliRunner().invoke(main, ["-q", "verify", *map(str, args), "--max-new-tokens", "2"])


def test_reference_from_the_cache_by_repo_and_commit(hub_artifact):
    doc = json.loads((hub_artifact / "porter.json").read_text())
    assert doc["source"]["repo_id"] == "MiniMaxAI/Tiny-M3" and doc["source"]["commit"] == SHA
    # the recorded local path is gone (cache moved, other machine): verify resolves repo id + commit
    doc["source"]["path"] = "/nonexistent/snapshot"
    (hub_artifact / "porter.json").write_text(json.dumps(doc))
    res = run(hub_artifact)
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output


def test_reference_repo_id_flag_and_missing_repo(hub_artifact):
    assert run(hub_artifact, "--reference", "MiniMaxAI/Tiny-M3").exit_code == 0
    res = run(hub_artifact, "--reference", "MiniMaxAI/Not-Cached")
    assert res.exit_code == 2 and "not in the Hugging Face cache" in res.output
