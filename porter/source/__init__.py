"""Open a source checkpoint: a local dir (porter.source.local) or a Hugging Face repo id fetched into the hub
cache first (porter.source.hub). Safetensors only, read lazily; never unpickles.

Source layer (docs/architecture.md): knows checkpoint folders and the hub, not any architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from porter.source import hub
from porter.source.local import INDEX_NAME, Source, SourceError, open_local

__all__ = ["INDEX_NAME", "Source", "SourceError", "open_local", "open_source"]


def open_source(
    source: str | Path,
    revision: Optional[str] = None,
    headers_only: bool = False,
    token: Optional[str] = None,
    cache_dir=None,
) -> Source:
    """A local dir, or a Hugging Face repo id resolved through the hub cache.
    headers_only: for a repo id, fetch only metadata and shard headers (enough to plan a --dry-run).
    token / cache_dir: for a repo id (None: huggingface_hub's HF_TOKEN / HF_HOME defaults)."""
    p = Path(source).expanduser()
    if p.exists():
        return open_local(p)
    if str(source).startswith((".", "/", "~")) or str(source).count("/") != 1:
        raise SourceError(f"{source}: no such directory, and not a Hugging Face repo id (owner/name)")
    if headers_only:
        path, commit, headers = hub.headers_only(str(source), revision, token, cache_dir)
        return open_local(path, repo_id=str(source), commit=commit, headers=headers)
    path, commit = hub.download(str(source), revision, token, cache_dir)
    return open_local(path, repo_id=str(source), commit=commit)
