"""Reading files of a model folder without trusting them, and writing porter's own files without following
anything planted at their names.

Every path a file of the folder names (an index's shard names) must stay inside the folder once symlinks
are resolved, and must be a regular file: a FIFO would block the open forever, a directory or device is
no model file. Malformed JSON is a porter error naming the file, never a bare JSONDecodeError.

Writing: porter creates each file it writes new (O_CREAT | O_EXCL | O_NOFOLLOW, under a temporary name)
and renames it into place only over nothing or a regular file, so a symlink, FIFO or folder left at one of
porter's names is never followed, written through or replaced: it is an error naming it.
"""

from __future__ import annotations

import json
import os
import shutil
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
    """folder / name, refused unless the name stays inside `folder` as written (no absolute path, no `..`
    leading out) and resolves to a path inside the resolved `folder` (no symlink pointing out). A Hugging
    Face cache snapshot (.../snapshots/<commit>/) holds symlinks into its repo's blobs/: there a symlink may
    also resolve into that blobs/ folder, never elsewhere in the cache (another snapshot, refs/)."""
    by = f" (named in {named_by})" if named_by else ""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{folder}: file name {name!r}{by} is not a file name; re-create that file")
    root = Path(folder).resolve()
    roots = [root]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        roots.append((root.parent.parent / "blobs").resolve())
    p = Path(folder) / name
    try:
        target = p.resolve(strict=False)
    except (OSError, RuntimeError) as e:  # symlink loop on older Pythons
        raise error(f"{p}{by}: cannot be resolved ({e}); fix or restore it") from None
    lexical = os.path.normpath(name)
    if (
        Path(name).is_absolute()
        or lexical == ".."
        or lexical.startswith("../")
        or not any(r in target.parents for r in roots)
    ):
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


# ---------------------------------------------------------------------------------------------------
# writing porter's own files


def check_replaceable(path: Path, error: Type[PorterError]) -> None:
    """Nothing at `path`, or a regular file (porter's own, from an earlier run): porter may write it. A
    symlink, folder, FIFO or device there was not made by porter: `error` naming it, nothing touched."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise error(f"{path}: cannot be checked ({e.strerror}); fix or remove it, then rerun") from None
    if stat.S_ISLNK(st.st_mode):
        kind = "a symlink"
    elif not stat.S_ISREG(st.st_mode):
        kind = "not a regular file (a folder, FIFO or device)"
    else:
        return
    raise error(
        f"{path}: {kind} at a name porter writes; porter did not make it and will not write through or "
        "replace it: move it away, then rerun"
    )


def create_new(path: Path, error: Type[PorterError], mode: int = 0o644) -> int:
    """A descriptor of a new, empty regular file at `path`, open for reading and writing. Opened with
    O_CREAT | O_EXCL | O_NOFOLLOW, so it is never an existing file or a link's target; a regular file at
    that name (a temporary file of a killed porter run) is removed first, anything else is `error`."""
    path = Path(path)
    check_replaceable(path, error)
    try:
        os.unlink(path)  # regular (checked): a stale temporary of porter's; a link swapped in meanwhile is
    except FileNotFoundError:  # only the link removed, never its target
        pass
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        raise error(
            f"{path}: created by another process while porter was writing it; stop the other writer, then rerun"
        ) from None


def replace_into(tmp: Path, path: Path, error: Type[PorterError]) -> None:
    """Rename porter's finished temporary `tmp` to `path`, which must be absent or a regular file."""
    check_replaceable(path, error)
    os.replace(tmp, path)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def atomic_write(path: Path, data: bytes, error: Type[PorterError], before_rename=None) -> None:
    """Write `path` so that it is either absent/old or complete: a new temporary file (create_new), fsync,
    then rename over nothing or a regular file. `before_rename` runs in between (fault injection)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = create_new(tmp, error)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    if before_rename is not None:
        before_rename()
    replace_into(tmp, path, error)


def copy_into(src: Path, dst: Path, error: Type[PorterError]) -> None:
    """Copy the regular file `src` to `dst` the way atomic_write writes (never through a link at `dst`)."""
    regular_file(src, error, "file to copy")
    tmp = Path(dst).with_name(Path(dst).name + ".tmp")
    fd = create_new(tmp, error)
    try:
        with open(src, "rb") as f, os.fdopen(os.dup(fd), "wb") as out:
            shutil.copyfileobj(f, out, 1 << 20)
        os.fsync(fd)
    finally:
        os.close(fd)
    replace_into(tmp, dst, error)
