"""Hugging Face Hub access: config/index/tokenizer first, then only the shards the index names.

Honours --revision, HF_TOKEN, HF_HOME and HF_HUB_OFFLINE (all read by huggingface_hub itself).
Refuses pickle-only repos before downloading weights.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from porter.errors import SourceError
from porter.source.local import INDEX_NAME, PICKLE_SUFFIXES, read_header

log = logging.getLogger("porter")

META_PATTERNS = ["config.json", INDEX_NAME, "generation_config.json", "tokenizer*", "special_tokens_map.json",
                 "chat_template*", "*.jinja", "preprocessor_config.json", "processor_config.json"]


def _snapshot(repo_id: str, revision, allow_patterns) -> Path:
    """snapshot_download with one-line errors. Never force_download, never clear the cache: huggingface_hub
    resumes an interrupted download from its .incomplete file on the next run."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns))
    except LocalEntryNotFoundError:
        raise SourceError(f"{repo_id}: not in the Hugging Face cache ({_cache_dir()}) and the hub cannot be "
                          "reached (offline?); download it where there is network or pass a local dir") from None
    except GatedRepoError:
        raise SourceError(f"{repo_id}: gated repo; accept its terms on huggingface.co and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise SourceError(f"{repo_id}: no such repo on the Hugging Face Hub (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise SourceError(f"{repo_id}: revision {revision!r} not found") from None
    except HfHubHTTPError as e:
        raise SourceError(_http_error_line(repo_id, e)) from None
    except OSError as e:  # network errors surface as OSError subclasses (requests/httpx)
        raise SourceError(f"{repo_id}: download failed ({type(e).__name__}: {_first_line(e)}); retry — finished "
                          "files and partial downloads stay in the cache and resume") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _http_error_line(repo_id: str, e) -> str:
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status == 401:
        return (f"{repo_id}: the Hugging Face Hub refused the credentials (HTTP 401); set HF_TOKEN to a valid "
                "token (or run `hf auth login`)")
    if status == 403:
        return f"{repo_id}: access denied (HTTP 403); your token lacks access to this repo — request it on huggingface.co"
    return (f"{repo_id}: download failed (HTTP {status}: {_first_line(e)}); retry — finished files and partial "
            "downloads stay in the cache and resume")


def _cache_dir() -> str:
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def _list_files(repo_id: str, revision) -> list[str]:
    """Files of the repo when the hub is reachable (to spot pickle-only repos); [] offline."""
    from huggingface_hub import HfApi, constants
    if constants.HF_HUB_OFFLINE:
        return []
    try:
        return HfApi().list_repo_files(repo_id, revision=revision)
    except Exception:  # offline or transient: the snapshot step reports the real problem
        return []


def download(repo_id: str, revision=None) -> tuple[Path, str]:
    """Resolve a repo id to a local snapshot dir holding config, index, tokenizer and the needed shards.
    Returns (dir, commit sha)."""
    meta_dir = _snapshot(repo_id, revision, META_PATTERNS)
    commit = meta_dir.name  # snapshots/<commit sha>/
    index = meta_dir / INDEX_NAME
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = _list_files(repo_id, revision)
        if files and not any(f.endswith(".safetensors") for f in files):
            if any(f.endswith(PICKLE_SUFFIXES) for f in files):
                raise SourceError(f"{repo_id}: only pickle weights (*.bin/*.pt); porter never unpickles")
        shards = ["*.safetensors"]
    log.info("fetching %d shard(s) of %s@%s", len(shards), repo_id, commit[:12])
    path = _snapshot(repo_id, commit, META_PATTERNS + shards)
    return path, commit


def headers_only(repo_id: str, revision=None) -> tuple[Path, str, dict]:
    """For --dry-run: config/index/tokenizer plus every shard's safetensors header, fetched with HTTP range
    requests (no tensor data). Returns (dir with the metadata files, commit, {file: header dict})."""
    from huggingface_hub import get_safetensors_metadata
    meta_dir = _snapshot(repo_id, revision, META_PATTERNS)
    commit = meta_dir.name
    local = sorted(meta_dir.glob("*.safetensors"))
    if local:  # already fully cached
        return meta_dir, commit, {f.name: read_header(f) for f in local}
    try:
        info = get_safetensors_metadata(repo_id, revision=commit)
    except Exception as e:  # offline, or no safetensors
        raise SourceError(f"{repo_id}: cannot read shard headers for --dry-run ({type(e).__name__}: {e}); "
                          "the dry run needs the hub or a cached snapshot") from None
    headers = {f: {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in fm.tensors.items()}
               for f, fm in info.files_metadata.items()}
    return meta_dir, commit, headers
