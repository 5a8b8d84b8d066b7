"""This machine's record of the artifact shards a GPU load (or `porter verify`'s integrity) read and found
equal to porter.json's digests, so that a later load of the same unchanged files need not hash them again
(docs/runtime.md, "Loading").

    checked = CheckedShards(artifact)                  # this artifact's record, if this machine has one
    before = checked.snapshot(shards)                  # each shard's identity, taken before its bytes are read
    names = checked.trusted(shard, before)             # its tensors a load checked, if the file is unchanged
    checked.moved(before, shards)                      # those whose identity moved since (read unhashed: fail)
    checked.record(before, {shard: names_checked})     # after a load checked them

A shard's identity is what `os.stat` says of it: device, inode, size, modification and status-change time
(the rule git's index and Bazel's digest cache use to skip rehashing a file). Every write, truncation,
rename over it or `touch` changes the status-change time, which no program can set back, so a shard changed
through the file system since its check is hashed again and a changed tensor still fails the load. What the
record cannot see is a change below the file system (a disk's bit rot): `runtime.load(..., rehash=True)` and
`porter verify` hash every byte whatever the record says.

A check is recorded only when the shard's identity is the same after its bytes were read as before, and its
status-change time lies RACY_NS before the first look: a write in the same clock tick as that look would not
move the time (file system clocks tick in milliseconds, some in seconds), so a file changed that recently is
checked again next time. The record is keyed by the artifact's real path and porter.json's bytes, written
atomically, and is only ever an optimisation: one that cannot be read or written is ignored (logged).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

from porter.cache import cache_dir

log = logging.getLogger("porter")

RACY_NS = 2_000_000_000  # a shard changed less than this before it was looked at is not recorded
FORMAT = "porter-checked-shards/1"


def identity(st: os.stat_result) -> list:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class CheckedShards:
    """The record of one artifact (see the module docstring)."""

    def __init__(self, artifact: Path, rehash: bool = False, root: Optional[Path] = None):
        """rehash: trust nothing (every tensor is hashed), record what is checked all the same."""
        self.rehash = rehash
        artifact = Path(artifact).resolve()
        self.artifact = artifact
        key = hashlib.sha256(str(artifact).encode()).hexdigest()[:32]
        self.file = (root or cache_dir()) / "checked" / f"{key}.json"
        try:
            self.manifest_sha256 = hashlib.sha256((artifact / "porter.json").read_bytes()).hexdigest()
        except OSError:
            self.manifest_sha256 = None  # nothing trusted, nothing recorded
        self._lock = threading.Lock()
        self._shards = self._read()  # shard file name -> {"identity": [...], "tensors": [...]}

    def _read(self) -> dict:
        if self.manifest_sha256 is None:
            return {}
        try:
            doc = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.debug("%s: unreadable (%s); every shard is hashed", self.file, e)
            return {}
        ok = (
            isinstance(doc, dict)
            and doc.get("format") == FORMAT
            and doc.get("artifact") == str(self.artifact)
            and doc.get("manifest_sha256") == self.manifest_sha256
            and isinstance(doc.get("shards"), dict)
        )
        return dict(doc["shards"]) if ok else {}

    def snapshot(self, shards: Iterable[Path]) -> dict:
        """shard -> (identity, when it was taken in ns): what trusted() and record() compare against."""
        out = {}
        for f in shards:
            now = time.time_ns()
            try:
                out[f] = (identity(os.stat(f)), now)
            except OSError:
                continue  # the read that follows names the problem
        return out

    def trusted(self, shard: Path, before: dict) -> frozenset:
        """The tensors of `shard` a load checked while the file had the identity it has in `before`."""
        rec = self._shards.get(shard.name)
        seen = before.get(shard)
        if self.rehash or self.manifest_sha256 is None or seen is None or not isinstance(rec, dict):
            return frozenset()
        if rec.get("identity") != seen[0] or not isinstance(rec.get("tensors"), list):
            return frozenset()
        return frozenset(rec["tensors"])

    def moved(self, before: dict, shards: Iterable[Path]) -> list:
        """Those of `shards` whose identity is no longer the one in `before` (or that cannot be looked at)."""
        out = []
        for f in shards:
            try:
                still = identity(os.stat(f)) == before[f][0]
            except (OSError, KeyError):
                still = False
            if not still:
                out.append(f)
        return out

    def record(self, before: dict, checked: dict) -> None:
        """checked: shard -> names of its tensors whose bytes were just read and matched porter.json. Each
        shard whose identity did not move while they were read, and had not moved for RACY_NS before, is
        recorded with them (added to what it had under the same identity)."""
        if self.manifest_sha256 is None:
            return
        with self._lock:
            changed = False
            for shard, names in checked.items():
                seen = before.get(shard)
                if not names or seen is None:
                    continue
                ident, at = seen
                if ident[4] > at - RACY_NS or self.moved(before, [shard]):
                    continue
                rec = self._shards.get(shard.name)
                known = (
                    set(rec["tensors"]) if isinstance(rec, dict) and rec.get("identity") == ident else set()
                )
                if not set(names) <= known:
                    self._shards[shard.name] = {"identity": ident, "tensors": sorted(known | set(names))}
                    changed = True
            if changed:
                self._write()

    def _write(self) -> None:
        doc = {
            "format": FORMAT,
            "artifact": str(self.artifact),
            "manifest_sha256": self.manifest_sha256,
            "shards": self._shards,
        }
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.file.parent, prefix=".checked-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump(doc, fh)
                os.replace(tmp, self.file)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.debug("%s: not written (%s); the next load hashes every shard again", self.file, e)
