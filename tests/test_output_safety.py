"""Safety of `porter convert`'s output folder (docs/convert.md): the source is never written or removed,
--force removes only what porter wrote, free space is checked up front, a full disk leaves the output
resumable, and one run at a time writes an output folder (a flock held by real processes here).
"""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections import namedtuple
from pathlib import Path

import pytest
from click.testing import CliRunner

import porter
from porter.cli import main as cli
from porter.engine import output_guard
from porter.format import manifest

ROOT = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
JOURNAL = ".porter-journal.json"
SHARD_CAP = "300KB"  # several shards from the tiny checkpoint


def convert_cli(src, out, *extra):
    return CliRunner().invoke(
        cli,
        [
            "convert",
            str(src),
            "--output",
            str(out),
            "-q",
            "--device",
            "cpu",
            "--max-shard-size",
            SHARD_CAP,
            "--workers",
            "2",
            *map(str, extra),
        ],
    )


def one_error_line(res, *names) -> str:
    """exit 2, one `porter: error:` line naming every given string, no traceback."""
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("porter: error: "), res.output
    for n in names:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


def hashes(d: Path) -> dict:
    """sha256 of every file under d (relative path -> digest)."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def artifact_bytes(d: Path) -> dict:
    """Every file's bytes; porter.json without its creation time."""
    out = {}
    for p in sorted(d.iterdir()):
        data = p.read_bytes()
        if p.name == "porter.json":
            doc = json.loads(data)
            doc.pop("created")
            data = json.dumps(doc, sort_keys=True).encode()
        out[p.name] = data
    return out


@pytest.fixture
def src(tiny_vendor, tmp_path) -> Path:
    """A private copy of the tiny checkpoint (the tests below point --force at it)."""
    return Path(shutil.copytree(tiny_vendor, tmp_path / "src"))


@pytest.fixture(scope="module")
def clean(tiny_vendor, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("safety") / "clean"
    res = convert_cli(tiny_vendor, out)
    assert res.exit_code == 0, res.output
    return out


# ---------------------------------------------------------------------------------------------------
# the output is never the source


@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink"])
@pytest.mark.parametrize("flags", [("--force",), ("--resume",), ("--force", "--resume"), ()])
def test_output_overlapping_the_source_is_refused(src, tmp_path, where, flags):
    before = hashes(tmp_path)
    if where == "symlink":
        (tmp_path / "link").symlink_to(src)
        before = hashes(tmp_path)
    out = {"same": src, "inside": src / "converted", "contains": tmp_path, "symlink": tmp_path / "link"}[
        where
    ]
    line = one_error_line(convert_cli(src, out, *flags), out, "give an output folder apart from the source")
    assert {
        "same": "is the source",
        "inside": "is inside",
        "contains": "contains",
        "symlink": "is the source",
    }[where] in line
    assert hashes(tmp_path) == before  # every shard, config, index and tokenizer file byte-identical
    assert not (src / "converted").exists() and not (src / output_guard.LOCK_NAME).exists()


def test_force_refuses_a_checkpoint_folder_as_output(src, tmp_path):
    """Another HF checkpoint (not the source) given as --output with --force: nothing in it is porter's."""
    other = Path(shutil.copytree(src, tmp_path / "other_checkpoint"))
    before = hashes(tmp_path)
    res = convert_cli(src, other, "--force")
    line = one_error_line(res, "not written by porter", "--force only replaces")
    assert str(other / "config.json") in line  # the first foreign file, by name
    assert hashes(tmp_path) == before


def test_force_refuses_foreign_files_beside_a_porter_output(src, clean, tmp_path):
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    (out / "notes.md").write_text("mine")
    (out / "extra").mkdir()
    before = hashes(out)
    one_error_line(convert_cli(src, out, "--force"), out / "extra", "2 such entries")
    assert hashes(out) == before
    shutil.rmtree(out / "extra")
    one_error_line(convert_cli(src, out, "--force"), out / "notes.md", "1 such entry")
    assert hashes(out) == before


def test_force_replaces_an_earlier_porter_output(tiny_vendor, clean, tmp_path):
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    res = convert_cli(tiny_vendor, out, "--force", "--max-shard-size", "200KB")  # another plan, other names
    assert res.exit_code == 0, res.output
    assert not (out / output_guard.LOCK_NAME).exists()
    shards = json.loads((out / INDEX).read_text())["weight_map"].values()
    assert sorted(p.name for p in out.glob("model-*")) == sorted(set(shards))  # the old shards are gone


@pytest.mark.parametrize("output", ["", " ", "\t"])
def test_empty_output_is_a_usage_error(tiny_vendor, tmp_path, monkeypatch, output):
    monkeypatch.chdir(tmp_path)
    one_error_line(convert_cli(tiny_vendor, output, "--force"), "--output is empty")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(output_guard.OutputFolderError, match="--output is empty"):
        porter.convert(tiny_vendor, output, progress=False)


def test_output_that_is_a_file_or_unwritable_is_one_line(tiny_vendor, tmp_path):
    (tmp_path / "file").write_text("x")
    assert convert_cli(tiny_vendor, tmp_path / "file").exit_code == 2  # click's own check
    with pytest.raises(output_guard.OutputFolderError, match="is a file, not a folder"):
        porter.convert(tiny_vendor, tmp_path / "file", progress=False)
    assert (tmp_path / "file").read_text() == "x"
    out = tmp_path / "out"
    out.mkdir()
    (out / output_guard.LOCK_NAME).symlink_to(tmp_path / "file")  # never followed, never written through
    one_error_line(convert_cli(tiny_vendor, out), out / output_guard.LOCK_NAME, "cannot create porter's lock")
    assert (tmp_path / "file").read_text() == "x"


# ---------------------------------------------------------------------------------------------------
# disk space


Usage = namedtuple("Usage", "total used free")


def test_free_space_is_checked_before_writing(tiny_vendor, tmp_path, monkeypatch):
    plan = porter.convert(tiny_vendor, tmp_path / "x", dry_run=True, max_shard_size=SHARD_CAP, progress=False)
    free = plan["output_bytes"] // 2
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * free, 9 * free, free))
    out = tmp_path / "new" / "out"
    res = convert_cli(tiny_vendor, out)
    line = one_error_line(res, out, f"only {free / 1e9:.3f} GB ({free} bytes) is free")
    needed = int(line.split("needs ")[1].split("(")[1].split(" bytes")[0])
    assert plan["output_bytes"] < needed < plan["output_bytes"] + (2 << 20)  # shards + headers + JSON room
    assert list(tmp_path.iterdir()) == []  # refused before any write; the folders it made are gone too
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * needed, 9 * needed, needed))
    assert convert_cli(tiny_vendor, out).exit_code == 0  # exactly enough is enough


class FullDisk:
    """os.pwrite that fails with ENOSPC on its n-th write into a `.partial` shard."""

    def __init__(self, n: int):
        self.real, self.n, self.calls = os.pwrite, n, 0

    def __call__(self, fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            self.calls += 1
            if self.calls == self.n:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.real(fd, data, offset)


def test_full_disk_mid_run_is_resumable(tiny_vendor, clean, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        mp.setattr(os, "pwrite", FullDisk(12))
        line = one_error_line(convert_cli(tiny_vendor, out), out, "no space left", "--resume")
    assert not (out / INDEX).exists() and not (out / output_guard.LOCK_NAME).exists()
    journal = json.loads((out / JOURNAL).read_text())
    assert journal["fingerprint"] and list(out.glob("*.partial")), line
    assert convert_cli(tiny_vendor, out, "--resume").exit_code == 0
    assert artifact_bytes(out) == artifact_bytes(clean)


def test_force_removes_an_interrupted_porter_run(tiny_vendor, clean, tmp_path, monkeypatch):
    """The journal names the files the interrupted run planned (.partial shards too): --force removes them."""
    out = tmp_path / "out"
    with monkeypatch.context() as mp:
        mp.setattr(os, "pwrite", FullDisk(5))
        one_error_line(convert_cli(tiny_vendor, out), "no space left")
    assert list(out.glob("*.partial"))
    assert convert_cli(tiny_vendor, out, "--force").exit_code == 0
    assert artifact_bytes(out) == artifact_bytes(clean)


# ---------------------------------------------------------------------------------------------------
# one writer per output folder, with real processes

HOLD_LOCK = """
import sys, time
sys.path.insert(0, {root!r})
from porter.engine.output_guard import OutputLock
OutputLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""

# a real conversion held inside its first shard: its first data write into a .partial blocks
HOLD_IN_SHARD = """
import os, sys, time
sys.path.insert(0, {root!r})
import porter
real = os.pwrite
def pwrite(fd, data, offset):
    if offset > 0 and os.readlink(f"/proc/self/fd/{{fd}}").endswith(".partial"):
        print("inside", flush=True)
        time.sleep(120)
    return real(fd, data, offset)
os.pwrite = pwrite
porter.convert(sys.argv[2], sys.argv[1], max_shard_size="300KB", progress=False, workers=1, device="cpu")
"""


def start(script: str, *args) -> subprocess.Popen:
    code = textwrap.dedent(script).format(root=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()  # blocks until the child holds the lock (or dies)
    assert line in ("locked", "inside"), proc.stderr.read()
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


def test_second_run_is_refused_while_a_conversion_is_inside_a_shard(tiny_vendor, tmp_path):
    out = tmp_path / "out"
    proc = start(HOLD_IN_SHARD, out, tiny_vendor)
    try:
        partial = sorted(out.glob("*.partial"))
        assert partial
        sizes = {p.name: p.stat().st_size for p in partial}
        for flags in ((), ("--resume",), ("--force",), ("--force", "--resume")):
            t0 = time.monotonic()
            res = convert_cli(tiny_vendor, out, *flags)
            line = one_error_line(res, out, f"pid {proc.pid} on ", "another porter run")
            assert time.monotonic() - t0 < 20, line  # refused at once, not after waiting
        assert {p.name: p.stat().st_size for p in sorted(out.glob("*.partial"))} == sizes  # not truncated
        assert not (out / INDEX).exists()
        holder = (out / output_guard.LOCK_NAME).read_text().split()
        assert holder[0] == str(proc.pid)
    finally:
        stop(proc)


def test_lock_holder_is_named_and_a_killed_holder_is_recovered(tiny_vendor, clean, tmp_path):
    out = tmp_path / "out"
    proc = start(HOLD_LOCK, out)
    try:
        one_error_line(convert_cli(tiny_vendor, out), f"pid {proc.pid} on ")
        one_error_line(convert_cli(tiny_vendor, out, "--resume", "--force"), f"pid {proc.pid} on ")
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # kill -9: the lock file stays, the kernel drops the flock
        proc.wait(timeout=30)
    assert (out / output_guard.LOCK_NAME).read_text().split()[0] == str(proc.pid)
    res = convert_cli(tiny_vendor, out, "--resume")  # -q: warnings are still shown
    assert res.exit_code == 0, res.output
    assert "taking over the lock" in res.output and f"(pid {proc.pid} on " in res.output, res.output
    assert artifact_bytes(out) == artifact_bytes(clean)  # no lock file left; the same artifact


def test_lock_file_is_no_shard_and_verify_inspect_accept_it(clean, tmp_path):
    """A stale lock (its run was killed after the index) changes neither inspect nor the integrity check."""
    from porter.commands.verify.integrity import check_integrity

    out = Path(shutil.copytree(clean, tmp_path / "out"))
    (out / output_guard.LOCK_NAME).write_text("12345 somehost\n")
    res = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert output_guard.LOCK_NAME not in res.output
    report = check_integrity(out, manifest.read(out))
    assert report.passed and report.issues == [], report
    assert report.shards == len(list(out.glob("model-*.safetensors")))
