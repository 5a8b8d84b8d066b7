"""porter's folder on this machine for what it keeps between runs (the compiled C quantizer, the record of
checked shards): $PORTER_CACHE_DIR, else $XDG_CACHE_HOME/porter, else ~/.cache/porter. Read when needed,
never at import time (docs/architecture.md, "Environment variables")."""

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("PORTER_CACHE_DIR"):
        return Path(os.environ["PORTER_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "porter"
