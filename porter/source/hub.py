"""Hugging Face Hub access: config/index/tokenizer first, then only the shards the index names.

Honours --revision, --token and --cache-dir; without the last two, HF_TOKEN (or the stored login) and
HF_HOME / HF_HUB_CACHE, read by huggingface_hub itself, as is HF_HUB_OFFLINE. Refuses pickle-only repos
before downloading weights. tests/test_hub.py runs all of this against a real hub server (docs/hub.md).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Optional

from porter.errors import SourceError
from porter.source.local import INDEX_NAME, PICKLE_SUFFIXES, read_header

log = logging.getLogger("porter")
_SHA = re.compile(r"[0-9a-f]{40}")

META_PATTERNS = [
    "config.json",
    INDEX_NAME,
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
    "*.jinja",
    "preprocessor_config.json",
    "processor_config.json",
    "README.md",
    "LICENSE*",
]  # the model card and license travel with the artifact


def snapshot_commit(path) -> Optional[str]:
    """The commit a Hugging Face cache snapshot folder (.../snapshots/<40-hex sha>) holds, else None."""
    p = Path(path).resolve()
    return p.name if p.parent.name == "snapshots" and _SHA.fullmatch(p.name) else None


def _snapshot(repo_id: str, revision, allow_patterns, token=None, cache_dir=None) -> Path:
    """snapshot_download with one-line errors. Never force_download, never clear the cache: files finished
    before an interruption stay in the cache and are not fetched again; a file cut mid-body is retried
    with a range request within the run, else fetched anew on the next."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=allow_patterns, token=token, cache_dir=cache_dir
            )
        )
    except LocalEntryNotFoundError:
        raise SourceError(
            f"{repo_id}: not in the Hugging Face cache ({cache_dir or _cache_dir()}) and the "
            "hub cannot be reached (offline?); download it where there is network or pass a "
            "local dir"
        ) from None
    except GatedRepoError:
        raise SourceError(
            f"{repo_id}: gated repo; accept its terms on huggingface.co and pass --token (or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:  # also what a mirror answers for an unknown revision (docs/hub.md)
        raise SourceError(
            f"{repo_id}: no such repo{_at(revision)} on the Hugging Face Hub (or it is "
            "private: pass --token or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise SourceError(f"{repo_id}: revision {revision!r} not found") from None
    except HfHubHTTPError as e:
        raise SourceError(_http_error_line(repo_id, e)) from None
    except (OSError, *_http_library_errors()) as e:  # network errors
        raise SourceError(
            f"{repo_id}: download failed ({type(e).__name__}: {_first_line(e)}); retry — finished "
            "files stay in the cache and are not fetched again"
        ) from None


def _at(revision) -> str:
    return f" at revision {revision!r}" if revision else ""


def _http_library_errors() -> tuple:
    """The error base of huggingface_hub's HTTP library (httpx, or its fork httpx2): a connection dropped
    mid-download raises its RemoteProtocolError, no OSError. With requests (huggingface_hub < 1.0) these
    are OSErrors."""
    from huggingface_hub.errors import HfHubHTTPError

    return tuple(c for c in HfHubHTTPError.__mro__[1:] if c.__name__ == "HTTPError")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _http_error_line(repo_id: str, e) -> str:
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status == 401:
        return (
            f"{repo_id}: the Hugging Face Hub refused the credentials (HTTP 401); pass a valid --token "
            "(or set HF_TOKEN, or run `hf auth login`)"
        )
    if status == 403:
        return (
            f"{repo_id}: access denied (HTTP 403); your token lacks access to this repo — request it "
            "on huggingface.co"
        )
    return (
        f"{repo_id}: download failed (HTTP {status}: {_first_line(e)}); retry — finished files stay "
        "in the cache and are not fetched again"
    )


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _list_files(repo_id: str, revision, token=None) -> list[str]:
    """Files of the repo when the hub is reachable (to spot pickle-only repos); [] offline."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return []
    try:
        return HfApi().list_repo_files(repo_id, revision=revision, token=token)
    except Exception:  # offline or transient: the snapshot step reports the real problem
        return []


def download(repo_id: str, revision=None, token=None, cache_dir=None) -> tuple[Path, str]:
    """Resolve a repo id to a local snapshot dir holding config, index, tokenizer, model card, license and
    the needed shards. Returns (dir, commit sha). token / cache_dir: None means huggingface_hub's default."""
    meta_dir = _snapshot(repo_id, revision, META_PATTERNS, token, cache_dir)
    commit = meta_dir.name  # snapshots/<commit sha>/
    index = meta_dir / INDEX_NAME
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = _list_files(repo_id, revision, token)
        if files and not any(f.endswith(".safetensors") for f in files):
            if any(f.endswith(PICKLE_SUFFIXES) for f in files):
                raise SourceError(f"{repo_id}: only pickle weights (*.bin/*.pt); porter never unpickles")
        shards = ["*.safetensors"]
    log.info("fetching %d shard(s) of %s@%s", len(shards), repo_id, commit[:12])
    path = _snapshot(repo_id, commit, META_PATTERNS + shards, token, cache_dir)
    return path, commit


def headers_only(repo_id: str, revision=None, token=None, cache_dir=None) -> tuple[Path, str, dict]:
    """For --dry-run: config/index/tokenizer plus every shard's safetensors header, fetched with HTTP range
    requests (no tensor data). Returns (dir with the metadata files, commit, {file: header dict})."""
    from huggingface_hub import get_safetensors_metadata

    meta_dir = _snapshot(repo_id, revision, META_PATTERNS, token, cache_dir)
    commit = meta_dir.name
    local = sorted(meta_dir.glob("*.safetensors"))
    if local:  # already fully cached
        return meta_dir, commit, {f.name: read_header(f) for f in local}
    try:
        info = get_safetensors_metadata(repo_id, revision=commit, token=token)
    except Exception as e:  # offline, or no safetensors
        raise SourceError(
            f"{repo_id}: cannot read shard headers for --dry-run ({type(e).__name__}: {e}); "
            "the dry run needs the hub or a cached snapshot"
        ) from None
    headers = {
        f: {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in fm.tensors.items()}
        for f, fm in info.files_metadata.items()
    }
    return meta_dir, commit, headers
