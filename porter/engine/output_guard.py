"""Safety of `porter convert`'s output folder (docs/convert.md, "Safety of the output folder").

- The output may not be the source, lie inside it or contain it (symlinks resolved).
- `--force` removes only files porter wrote: those named by an earlier run's journal or porter.json (and
  porter's own fixed file names next to them); any other file makes it refuse, naming that file. The
  removal is journaled and ordered so that a run killed part-way never leaves a complete-looking folder.
- Porter never writes through a symlink (or into a FIFO or folder) at one of its own file names.
- Free space is checked against the planned output size before the first shard byte is written; a disk
  that fills up anyway (ENOSPC) is a one-line error that leaves the output resumable.
- One writer per output folder: an exclusive flock on `.porter.lock` inside it, for the whole run.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

from porter.engine.faults import fault_point
from porter.errors import OutputFolderError
from porter.format import journal as journal_file
from porter.format.journal import JOURNAL
from porter.format.safe_files import check_replaceable, read_json_object

log = logging.getLogger("porter")

LOCK_NAME = ".porter.lock"
MANIFEST = "porter.json"  # porter.format.manifest.MANIFEST (not imported: this module stays import-light)
MANIFEST_FORMAT = "porter-mxfp8"
INDEX = "model.safetensors.index.json"
FIXED_FILES = ("config.json", MANIFEST, INDEX)  # every conversion writes these (each via a .tmp file)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


# ---------------------------------------------------------------------------------------------------
# where the output may be


def check_output_option(output) -> Path:
    """--output as a Path; empty or blank is a usage error (Path("") is the current directory)."""
    if output is None or not str(output).strip():
        raise OutputFolderError("--output is empty: give the folder to write the artifact into")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise OutputFolderError(
            f"--output {out} is a file, not a folder; give a folder to write the artifact into"
        )
    return out


def check_apart_from_source(out: Path, source_dir: Path) -> None:
    """Refuses an output that is the source folder, lies inside it or contains it (after resolving
    symlinks): writing there would overwrite, or --force remove, the checkpoint being read."""
    o, s = Path(out).resolve(), Path(source_dir).resolve()
    if o == s:
        what = "is the source checkpoint folder"
    elif s in o.parents:
        what = f"is inside the source checkpoint folder {s}"
    elif o in s.parents:
        what = f"contains the source checkpoint folder {s}"
    else:
        return
    raise OutputFolderError(f"--output {out} {what}; give an output folder apart from the source")


# ---------------------------------------------------------------------------------------------------
# what porter wrote


def _read_json(path: Path) -> dict:
    try:  # stat first (safe_files): a FIFO where porter.json should be must not block
        return read_json_object(path, OutputFolderError)
    except OutputFolderError:
        return {}


def porter_written(out: Path, copy_files: Iterable[str]) -> set:
    """Names of the files in `out` that an earlier porter run into it wrote, as its journal (an interrupted
    run: the files it planned) or its porter.json and index (a complete one) say. Empty when neither is
    there: then nothing in the folder is porter's."""
    journal = journal_file.read(out)
    manifest = _read_json(out / MANIFEST)
    index = _read_json(out / INDEX)
    owned = set()
    if journal.get("fingerprint"):
        owned |= {JOURNAL, *_names(journal.get("files")), *_names(journal.get("shards"))}
        owned |= set(_names(journal.get("removing")))  # an interrupted --force removal: what was left
    if manifest.get("format") == MANIFEST_FORMAT:
        owned |= {*FIXED_FILES, *copy_files, *manifest.get("shards", {})}
        weight_map = index.get("weight_map")
        if isinstance(weight_map, dict):
            owned |= set(weight_map.values())
    owned = {n for n in owned if isinstance(n, str) and "/" not in n}
    owned |= {n + suffix for n in owned for suffix in (".partial", ".tmp")}
    owned.add(JOURNAL + ".tmp")  # a run killed before its first journal write leaves only this
    return owned


def _names(value) -> list:
    return list(value) if isinstance(value, (list, dict)) else []


def foreign_files(out: Path, copy_files: Iterable[str]) -> list:
    """Entries of `out` porter did not write (sorted): folders, symlinks, files no earlier run names."""
    owned = porter_written(out, copy_files) | {LOCK_NAME}
    return sorted(p.name for p in out.iterdir() if p.is_symlink() or not p.is_file() or p.name not in owned)


def has_content(out: Path) -> bool:
    """Whether `out` holds anything besides porter's lock file."""
    return out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir())


def check_own_names(out: Path, names: Iterable[str]) -> None:
    """Each of porter's own names in `out` (what this run writes, its temporary names, what it reads back)
    is absent or a regular file: a symlink, FIFO or folder planted there is refused, naming it, before any
    file is touched."""
    for name in sorted(set(names)):
        check_replaceable(out / name, OutputFolderError)


# the order --force removes an earlier output in: the index first (its presence means complete), then
# porter.json and config.json, then everything else; the journal (rewritten first) stays
REMOVAL_ORDER = (INDEX, MANIFEST, "config.json")


def removal_order(names: Iterable[str]) -> list:
    names = set(names) - {JOURNAL, LOCK_NAME}
    return [n for n in REMOVAL_ORDER if n in names] + sorted(names - set(REMOVAL_ORDER))


def check_removable(out: Path, names: Iterable[str]) -> None:
    """Every entry can be removed by this process (the folder writable, and with the sticky bit owned by
    us), before anything is: a removal refused half-way would leave half an output."""
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputFolderError(
            f"{out}: porter cannot remove files from this folder (not writable); fix its permissions or "
            "choose another --output"
        )
    st = os.stat(out)
    if st.st_mode & stat.S_ISVTX and os.geteuid() not in (0, st.st_uid):
        for name in names:
            if os.lstat(out / name).st_uid != os.geteuid():
                raise OutputFolderError(
                    f"{out / name}: owned by another user in a sticky folder, porter cannot remove it; "
                    "remove it yourself or choose another --output"
                )


def remove_listed(out: Path, names: list) -> None:
    """Remove `names` from `out` in that order (missing ones are skipped). A file that cannot be removed is
    one line naming it; what is left is still listed in the journal (`removing`), so --force finishes."""
    for name in names:
        try:
            (out / name).unlink(missing_ok=True)
            fault_point("remove")
        except OSError as e:
            raise OutputFolderError(
                f"{out / name}: cannot remove it ({e.strerror}); the earlier output is partly removed "
                "(its index and porter.json first): fix this, then rerun with --force"
            ) from None


def clear_for_force(out: Path, copy_files: Iterable[str], journal: dict) -> None:
    """--force: remove what earlier porter runs wrote into `out`; refuse (removing nothing) when anything
    else is there, or when something cannot be removed. Crash-safe: `journal` (the new conversion's, no
    shard done) is written first with the files still to remove, then the index, porter.json and config.json
    go, then the rest, then the journal is rewritten without the list. Killed anywhere, the folder reads as
    an interrupted conversion (never a complete one) whose files --force (or --resume) finishes removing."""
    foreign = foreign_files(out, copy_files)
    if foreign:
        entries = "1 such entry" if len(foreign) == 1 else f"{len(foreign)} such entries"
        raise OutputFolderError(
            f"{out / foreign[0]}: not written by porter ({entries} in {out}); "
            "--force only replaces an earlier porter output: choose an empty or new "
            "--output folder"
        )
    order = removal_order(p.name for p in out.iterdir())
    check_removable(out, order)
    journal_file.write(out, {**journal, "removing": order})
    remove_listed(out, order)
    journal_file.write(out, journal)


# ---------------------------------------------------------------------------------------------------
# free space


def _nearest_existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _allocated_bytes(out: Path, names: set) -> int:
    total = 0
    for name in names:
        try:
            total += os.stat(out / name, follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    return total


def check_free_space(out: Path, needed: int, reusable: Iterable[str] = ()) -> None:
    """Refuses to start when the output's file system lacks `needed` bytes (the planned output), counting
    the disk space of `reusable` files in `out` (an earlier run's, which --force removes and --resume
    rewrites or keeps) as free."""
    free = shutil.disk_usage(_nearest_existing(out)).free
    have = free + (_allocated_bytes(out, set(reusable)) if out.is_dir() else 0)
    if have < needed:
        raise OutputFolderError(
            f"{out}: the output needs {needed / 1e9:.3f} GB ({needed} bytes) but only "
            f"{have / 1e9:.3f} GB ({have} bytes) is free there; free space or choose "
            "another --output"
        )


@contextmanager
def disk_full_is_bad_input(out: Path):
    """A full disk (ENOSPC, or a quota) while writing: one line, exit 2. The shards finished so far are in
    the journal and no index is written, so `--resume` continues once there is room."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        where = f" writing {e.filename}" if e.filename else ""
        raise OutputFolderError(
            f"{out}: no space left on the device{where}; free space, then rerun with --resume to continue"
        ) from None


# ---------------------------------------------------------------------------------------------------
# one writer per output folder


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 256).decode(errors="replace").split()
    return f"pid {text[0]} on {text[1]}" if len(text) >= 2 else "pid unknown"


class OutputLock:
    """An exclusive flock on `out/.porter.lock`, which holds the holder's "pid host". The kernel drops a
    flock when its process dies, so a lock file left by a killed run is taken over (and said so). The file
    is removed on release; a run that opened it just before is caught by the inode check in acquire."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self.fd: Optional[int] = None
        self.made: list = []  # the folders acquire created, innermost first

    def acquire(self) -> "OutputLock":
        self.made = [p for p in (self.out.absolute(), *self.out.absolute().parents) if not p.exists()]
        while True:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                fd = os.open(  # O_NONBLOCK: opening a FIFO planted there must not wait for a writer
                    self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644
                )
            except OSError as e:  # not writable, a file in the way, .porter.lock a symlink (O_NOFOLLOW)
                if e.errno in DISK_FULL:
                    raise
                if e.errno == errno.ELOOP:
                    raise OutputFolderError(
                        f"{self.path}: a symlink at the name of porter's lock file; porter did not make it "
                        "and will not follow it: move it away, then rerun"
                    ) from None
                raise OutputFolderError(
                    f"{self.path}: cannot create porter's lock file there "
                    f"({e.strerror}); give a writable --output folder"
                ) from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, device: not porter's lock file
                os.close(fd)
                raise OutputFolderError(
                    f"{self.path}: not a regular file (a FIFO or device) at the name of porter's lock "
                    "file; porter did not make it: move it away, then rerun"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise OutputFolderError(
                    f"{self.out}: another porter run ({holder}) is writing this output "
                    "folder; wait for it to end or stop it, then rerun"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file as we opened it: lock the new one
        stale = _holder(fd)
        if stale != "pid unknown":
            log.warning(
                "%s: taking over the lock of a porter run that ended without releasing it (%s)",
                self.out,
                stale,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                self.path.unlink()  # while still held: no one locks a file about to vanish; and only ours
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None
        for folder in self.made:  # a run refused before writing anything leaves no empty folders behind
            try:
                folder.rmdir()
            except OSError:  # not empty: what the run wrote stays (for --resume)
                break

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
