"""The journal of an unfinished `porter convert` (`.porter-journal.json` in the output folder).

It exists from the moment a conversion starts writing until its index is written (the index is written
last, then the journal removed), so "a journal and no index" means an interrupted conversion. It records:

- `fingerprint`: what a `--resume` must match (porter version, options, source bytes, output plan);
- `porter`, `options` (every option as given, never the Hub token) and `plan_options` (what the output
  is made with, as porter.json records it, plus the digest rule): a refused `--resume` names the option
  that differs;
- `command`: the argv that resumes it, original options included (`resume_command`);
- `source` (per-file sample digests) and `source_path`; `shards` (finished shard -> digests and tensor
  records); `shard_count`; `files` (every file the run may write: what `--force` may remove later);
- `removing` (only while `--force` clears an earlier output: the files still to remove, so a run killed
  part-way leaves a folder that reads as interrupted and that `--force` or `--resume` finishes clearing).

Every command that opens a folder (convert, inspect, verify, generate, runtime.load) recognises an
interrupted conversion through `interrupted()` and says how to resume it.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from porter.errors import OutputFolderError, PorterError
from porter.format.safe_files import atomic_write, read_json_object

JOURNAL = ".porter-journal.json"
INDEX = "model.safetensors.index.json"  # porter.source.INDEX_NAME (not imported: source is a layer above)


def read(out: Path) -> dict:
    """The journal in `out` as a dict; {} when there is none or it is not a JSON object in a regular file
    (a symlink at its name is not porter's journal)."""
    path = Path(out) / JOURNAL
    if os.path.islink(path):
        return {}
    try:
        return read_json_object(path, OutputFolderError, "journal")
    except PorterError:
        return {}


def write(out: Path, journal: dict, before_rename=None) -> None:
    """Atomically (porter.format.safe_files.atomic_write: never through a link planted at its names)."""
    atomic_write(Path(out) / JOURNAL, json.dumps(journal).encode(), OutputFolderError, before_rename)


def resume_command(journal: dict, folder: Optional[Path] = None) -> Optional[str]:
    """The shell command (each word quoted for a POSIX shell) that resumes the journaled conversion; its
    --output is `folder` (where the journal was found, absolute) when given: the folder may have moved."""
    argv = journal.get("command")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return None
    argv = list(argv)
    if folder is not None and "--output" in argv[:-1]:
        argv[argv.index("--output") + 1] = os.path.abspath(folder)
    return shlex.join(argv)


@dataclass(frozen=True)
class Interrupted:
    """An interrupted conversion's state, as its journal says."""

    path: Path
    done: Optional[int]  # finished shards (None: the journal does not say)
    total: Optional[int]  # planned shards
    command: Optional[str]  # resume_command()

    def state(self) -> str:
        """'interrupted conversion (N of M shards done): resume with CMD'."""
        done = "?" if self.done is None else self.done
        total = "?" if self.total is None else self.total
        how = self.command or f"porter convert SOURCE --output {shlex.quote(str(self.path))} --resume"
        return f"interrupted conversion ({done} of {total} shards done): resume with {how}"

    def __str__(self) -> str:
        return f"{self.path}: {self.state()}"


def interrupted(path: Path) -> Optional[Interrupted]:
    """The interrupted conversion in folder `path` (porter's journal and no index), else None."""
    path = Path(path)
    if os.path.lexists(path / INDEX) or not os.path.lexists(path / JOURNAL):
        return None
    journal = read(path)
    if not journal.get("fingerprint"):  # not porter's journal (or unreadable): nothing porter can resume
        return None
    shards, total = journal.get("shards"), journal.get("shard_count")
    done = len(shards) if isinstance(shards, dict) else None
    command = resume_command(journal, path)
    source = journal.get("source_path")
    if command is None and isinstance(source, str):  # a journal from before porter kept the command
        command = shlex.join(["porter", "convert", source, "--output", os.path.abspath(path), "--resume"])
    return Interrupted(path, done, total if type(total) is int else None, command)
