"""Reading files of a model folder without trusting them.

Every path a file of the folder names (an index's shard names) must stay inside the folder once symlinks
are resolved, and must be a regular file: a FIFO would block the open forever, a directory or device is
no model file. Malformed JSON is a porter error naming the file, never a bare JSONDecodeError.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Type

from porter.errors import PorterError


def regular_file(path: Path, error: Type[PorterError], what: str = "file") -> Path:
    """`path` if it is a regular file (after symlinks); else `error` naming it. Checked with stat before any
    open, so a FIFO is never opened."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: {what} missing") from None
    except OSError as e:  # a symlink loop (ELOOP), a path under a file (ENOTDIR), no permission
        raise error(f"{path}: {what} cannot be read ({e.strerror}); fix or restore it") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: {what} is not a regular file (a directory, FIFO or device); replace it")
    return path


def present(path: Path, error: Type[PorterError], what: str = "file") -> bool:
    """False when nothing is at `path` (an optional file); True for a regular file; else `error`."""
    if not os.path.lexists(path):
        return False
    regular_file(path, error, what)
    return True


def inside(folder: Path, name, error: Type[PorterError], named_by: str = "") -> Path:
    """folder / name, refused unless it resolves to a path inside the resolved `folder` (no `..`, no
    absolute path, no symlink pointing out). A Hugging Face cache snapshot (.../snapshots/<commit>/) holds
    symlinks into its repo's blobs/: there the repo's cache folder is the bound."""
    by = f" (named in {named_by})" if named_by else ""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{folder}: file name {name!r}{by} is not a file name; re-create that file")
    root = Path(folder).resolve()
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        root = root.parent.parent
    p = Path(folder) / name
    try:
        target = p.resolve(strict=False)
    except (OSError, RuntimeError) as e:  # symlink loop on older Pythons
        raise error(f"{p}{by}: cannot be resolved ({e}); fix or restore it") from None
    if Path(name).is_absolute() or root not in target.parents:
        raise error(f"{p}{by}: points outside {folder}; a model folder may only name its own files")
    return p


def read_bytes(path: Path, error: Type[PorterError], what: str = "file") -> bytes:
    regular_file(path, error, what)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise error(f"{path}: {what} cannot be read ({e.strerror}); fix or restore it") from None


def read_text(path: Path, error: Type[PorterError], what: str = "file") -> str:
    try:
        return read_bytes(path, error, what).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: {what} is not UTF-8 text (byte {e.start}); fix or restore it") from None


def read_json(path: Path, error: Type[PorterError], what: str = "file"):
    """Any JSON value of a regular UTF-8 file."""
    text = read_text(path, error, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: {what} is not valid JSON ({e}); fix or restore it") from None
    except RecursionError:
        raise error(f"{path}: {what} nests JSON too deeply; fix or restore it") from None


def read_json_object(path: Path, error: Type[PorterError], what: str = "file") -> dict:
    """A JSON object from a regular UTF-8 file; any other shape is `error` naming the file."""
    doc = read_json(path, error, what)
    if not isinstance(doc, dict):
        raise error(f"{path}: {what} must hold a JSON object, found {type(doc).__name__}; fix or restore it")
    return doc
